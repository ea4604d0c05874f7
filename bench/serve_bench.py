import sys, httpx
url = sys.argv[sys.argv.index("--url") + 1]
r = httpx.post(url + "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "pcm", "max_audio_length_ms": 160}, timeout=60)
print("FAKE serve_bench", r.status_code, len(r.content), r.headers.get("x-csmserve-replica"))
