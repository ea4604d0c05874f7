"""PCM -> wav/mp3/opus/flac/aac/pcm byte streams, resampling, reading uploaded audio."""
from csmserve.audio.decode import (AudioDecodeError, AudioTooLongError, check_duration, decode_audio,
                                   decode_audio_24k, duration_s)
from csmserve.audio.encoders import FORMATS, MEDIA_TYPES, SAMPLE_RATE, Encoder, make_encoder, wav_header
from csmserve.audio.resample import resample
from csmserve.audio.tempo import MAX_SPEED, MIN_SPEED, TimeStretch

__all__ = [
    "AudioDecodeError", "AudioTooLongError", "check_duration", "decode_audio", "decode_audio_24k", "duration_s",
    "FORMATS", "MEDIA_TYPES", "SAMPLE_RATE", "Encoder", "make_encoder", "wav_header",
    "resample", "MAX_SPEED", "MIN_SPEED", "TimeStretch",
]
