"""csmserve inside voice-agent frameworks, over csmserve's WebSocket (`/v1/audio/speech/stream`):

- `csmserve.integrations.pipecat.CSMTTSService`: a Pipecat TTS service (`pip install 'csmserve[pipecat]'`);
- `csmserve.integrations.livekit.TTS` (+ `ConversationAgent`): a LiveKit Agents TTS (`csmserve[livekit]`);
- `csmserve.integrations.conversation.Conversation`: the framework-free client both are built on.

Each keeps ONE csmserve conversation (a `context_id`) per agent session: the LLM's text goes in as it
arrives, the user's turns go in as context with their audio (`add_context`), so CSM answers in the
conversation's prosody, and an interruption cuts the assistant's turn at what was played.
Docs: docs/integrations.md.
"""
