"""Sample-rate conversion with libswresample (windowed-sinc polyphase filter)."""
from __future__ import annotations

import av
import numpy as np

# swr's default filter (16 taps/phase, cutoff 0.97) is already good for speech; no extra options
_CHUNK = 1 << 20  # samples per frame pushed; bounds the size of one AVFrame


def resample(pcm: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """[n] float32 at sr_in -> [~n * sr_out / sr_in] float32 at sr_out (whole clip, delay flushed)."""
    pcm = np.ascontiguousarray(pcm, dtype=np.float32).reshape(-1)
    if sr_in == sr_out or pcm.size == 0:
        return pcm.copy()
    swr = av.AudioResampler(format="flt", layout="mono", rate=sr_out)
    out: list[np.ndarray] = []
    for start in range(0, pcm.size, _CHUNK):
        frame = av.AudioFrame.from_ndarray(pcm[None, start:start + _CHUNK], format="flt", layout="mono")
        frame.sample_rate = sr_in
        out += [f.to_ndarray().reshape(-1) for f in swr.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in swr.resample(None)]  # the filter's tail
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
