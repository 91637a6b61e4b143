"""Audio input: any file libsndfile reads (WAV, FLAC, OGG/Vorbis/Opus, MP3) to 16 kHz mono float32,
and Gemma 4's log-mel features (shared/design/gemma4-audio.md §2, §4.2, §8).

Decoding is `soundfile` (libsndfile >= 1.1 reads MP3; its wheels bundle 1.2). Integer PCM is
scaled as §8 says (int16 / 2^15, 24- and 32-bit / 2^31; libsndfile returns 24-bit left-aligned in
int32), float as stored, other codecs through libsndfile's own float conversion. Channels are
averaged. Other rates are resampled to 16 kHz with soxr's HQ preset (20-bit precision, linear
phase: the resampler HF's own audio loader uses; from 44.1 kHz a 1 kHz and a 7 kHz tone keep their
level within 0.05 dB and a 12 kHz tone comes out below -90 dB, tests/models/test_audio_input.py), block
by block as the file is read, so a long 48 kHz stereo file never sits in memory at its own rate.

The features are the HF extractor's (§2) in torch: periodic Hann of 320 samples inside a
512-point FFT (torch.stft), magnitude, HTK mel bank of 128 filters over 0-8000 Hz, log(mel + 1e-3),
one frame per 10 ms after a 160-sample semicausal pad, and the frame-validity rule that gives
floor((L - 1) / 160) frames (99 for one second). Clips over 30 s are cut into 30 s pieces, each
with its own features and tokens (llama.cpp's behaviour, §7.4 item 2); together they fill one
audio block in the prompt.
"""
from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import torch

SAMPLE_RATE = 16000
FRAME, HOP, N_FFT, N_MEL = 320, 160, 512, 128  # 20 ms window, 10 ms hop, 32 ms FFT (§1.2)
MEL_FLOOR = 1e-3
PIECE_SAMPLES = 30 * SAMPLE_RATE  # 480000: 750 tokens, the longest clip the tower was trained on
MIN_SAMPLES = HOP + 1  # 161 samples (10.06 ms): one valid frame, one token (§8)
MAX_SECONDS = 30 * 60  # decoded-length cap, checked against the header before decoding: 45,000 tokens
MIN_RATE, MAX_RATE = 4000, 768000
MAX_CHANNELS = 64
READ_BLOCK = 1 << 16  # frames per read: 1.4 s of 48 kHz audio


class AudioError(ValueError):
    """A one-line refusal of an audio clip (not audio, too short, too long, absurd header...)."""


@dataclass(frozen=True)
class AudioInput:
    """One decoded clip: what a request carries and what the prefix cache keys on."""
    samples: torch.Tensor  # float32 [L], 16 kHz mono, nominally in [-1, 1]
    n_tokens: int  # soft tokens N over all 30 s pieces (§4.2)
    digest: str  # sha256 of the 16 kHz samples: equal sound, equal KV
    name: str = ""
    source_rate: int = SAMPLE_RATE
    channels: int = 1

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / SAMPLE_RATE

    def pieces(self) -> list[torch.Tensor]:
        """The 30 s pieces the tower encodes one by one (a tail under 161 samples gives no token)."""
        return [self.samples[i:i + PIECE_SAMPLES] for i in range(0, self.samples.shape[0], PIECE_SAMPLES)
                if self.samples.shape[0] - i >= MIN_SAMPLES or i == 0]


# --- counts (§2 step 4, §4.2) ------------------------------------------------------------------
def n_frames(n_samples: int) -> int:
    """Valid mel frames of one piece: frame i needs sample 160·i + 160 (one past its window's end)."""
    return (n_samples - 1) // HOP if n_samples > HOP else 0


def n_tokens(n_samples: int) -> int:
    """Soft tokens of a clip of `n_samples` at 16 kHz: ceil(frames / 4) per 30 s piece (25 a second)."""
    total = 0
    for start in range(0, max(n_samples, 1), PIECE_SAMPLES):
        total += -(-n_frames(min(PIECE_SAMPLES, n_samples - start)) // 4)
    return total


# --- features (§2) -----------------------------------------------------------------------------
@lru_cache(maxsize=4)
def mel_bank(n_fft: int = N_FFT, n_mel: int = N_MEL, rate: int = SAMPLE_RATE, fmin: float = 0.0,
             fmax: float = 8000.0) -> torch.Tensor:
    """float64 [n_fft/2 + 1, n_mel]: HTK-mel triangles, filter m over mel points m, m+1, m+2 (n_mel + 2
    points equally spaced in mel), evaluated in Hz at the FFT bins, no area normalisation (§2 step 7)."""
    def mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)
    pts = torch.linspace(mel(fmin), mel(fmax), n_mel + 2, dtype=torch.float64)
    hz = 700.0 * (10.0 ** (pts / 2595.0) - 1.0)  # [n_mel + 2]
    bins = torch.linspace(0, rate // 2, n_fft // 2 + 1, dtype=torch.float64)[:, None]  # [257, 1]
    rise = (bins - hz[None, :-2]) / (hz[1:-1] - hz[:-2])
    fall = (hz[None, 2:] - bins) / (hz[2:] - hz[1:-1])
    return torch.clamp(torch.minimum(rise, fall), min=0.0)


def log_mel(samples: torch.Tensor) -> torch.Tensor:
    """float32 [n_frames, 128] log-mel features of one piece (float [L] at 16 kHz, L <= 480000).

    torch.stft centres the 320-sample window in each 512-sample frame (96 zeros either side), so
    the signal gets 96 + 160 (the semicausal pad) = 256 leading zeros: frame i then covers the
    original samples [160·i - 160, 160·i + 160) exactly as HF's frame i does. Where a 320-sample
    frame sits inside the 512 FFT changes only the phase, not the magnitude. float64 throughout
    (HF: float32 FFT, float64 mel and log; the two agree to ~1e-5, §2)."""
    n = n_frames(samples.shape[0])
    if n == 0:
        return torch.zeros(0, N_MEL)
    lead = (N_FFT - FRAME) // 2 + FRAME // 2  # 256
    x = torch.zeros(HOP * (n - 1) + N_FFT, dtype=torch.float64)
    keep = min(samples.shape[0], x.shape[0] - lead)
    x[lead:lead + keep] = samples[:keep].to(torch.float64)
    window = torch.hann_window(FRAME, periodic=True, dtype=torch.float64)
    spec = torch.stft(x, N_FFT, HOP, FRAME, window, center=False, return_complex=True)  # [257, n]
    mel = spec.abs().T @ mel_bank()  # [n, 128]
    return torch.log(mel + MEL_FLOOR).float()


# --- decoding (§8) -----------------------------------------------------------------------------
def _label(source, name: str) -> str:
    return name or (Path(source).name if isinstance(source, (str, Path)) else "audio")


def _digest(samples: torch.Tensor) -> str:
    return hashlib.sha256(b"audio16k:" + samples.numpy().tobytes()).hexdigest()


def audio_from_samples(samples, rate: int, name: str = "audio", source_rate: Optional[int] = None,
                       channels: Optional[int] = None) -> AudioInput:
    """An AudioInput from decoded samples: [L] or [L, channels], int16 / int32 PCM or float, at
    `rate` Hz (resampled to 16 kHz). One-line AudioError for an empty, too short or absurd clip."""
    a = np.asarray(samples)
    if a.ndim not in (1, 2) or a.size == 0:
        raise AudioError(f"{name}: empty, no audio samples" if a.size == 0 else
                         f"{name}: samples of shape {list(a.shape)}; expected [frames] or [frames, channels]")
    _check_header(name, rate, a.shape[1] if a.ndim == 2 else 1, a.shape[0])
    x = _mono_float(a)
    if rate != SAMPLE_RATE:
        import soxr
        x = soxr.resample(x, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return _finish(x, name, source_rate or rate, channels or (a.shape[1] if a.ndim == 2 else 1))


def _mono_float(a: np.ndarray) -> np.ndarray:
    """float32 mono: int16 / 2^15, int32 / 2^31 (§8), floats as they are; channels averaged."""
    if a.dtype == np.int16:
        x = a.astype(np.float32) / 32768.0
    elif a.dtype == np.int32:
        x = (a.astype(np.float64) / 2147483648.0).astype(np.float32)
    elif a.dtype.kind == "f":
        x = a.astype(np.float32)
    else:
        raise AudioError(f"samples of type {a.dtype}: expected int16, int32 or float")
    if not np.isfinite(x).all():
        raise AudioError("samples are not finite (NaN or infinity)")
    return x.mean(axis=1, dtype=np.float32) if x.ndim == 2 else x


def _limit() -> str:
    return f"{MAX_SECONDS // 60}-minute limit" if MAX_SECONDS % 60 == 0 else f"{MAX_SECONDS} s limit"


def _check_header(label: str, rate: int, channels: int, frames: Optional[int]) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioError(f"{label}: sample rate {rate} Hz is outside {MIN_RATE}-{MAX_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"{label}: {channels} channels (at most {MAX_CHANNELS})")
    if frames is not None and frames > MAX_SECONDS * rate:
        raise AudioError(f"{label}: {frames / rate / 60:.0f} minutes of audio is over the {_limit()}")


def _finish(x: np.ndarray, label: str, source_rate: int, channels: int) -> AudioInput:
    if x.shape[0] == 0:
        raise AudioError(f"{label}: empty, no audio samples")
    if x.shape[0] < MIN_SAMPLES:
        raise AudioError(f"{label}: {1000 * x.shape[0] / SAMPLE_RATE:.1f} ms of audio is too short "
                         f"(at least {1000 * MIN_SAMPLES / SAMPLE_RATE:.1f} ms for one token)")
    if x.shape[0] > MAX_SECONDS * SAMPLE_RATE:
        raise AudioError(f"{label}: over the {_limit()}")
    samples = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return AudioInput(samples, n_tokens(samples.shape[0]), _digest(samples), label, source_rate, channels)


def _read_dtype(subtype: str) -> str:
    """How to read a subtype so the §8 scaling is ours: PCM as integers, the rest as float32."""
    return {"PCM_16": "int16", "PCM_24": "int32", "PCM_32": "int32"}.get(subtype, "float32")


def load_audio(source: str | Path | bytes, name: str = "") -> AudioInput:
    """A file (or its bytes) decoded to 16 kHz mono, or a one-line AudioError: not audio, a codec
    libsndfile cannot decode, an empty or too short clip, an absurd rate or channel count, or a
    header claiming more than MAX_SECONDS (refused before anything is decoded; a header that
    understates its length is stopped at the same cap while reading)."""
    import soundfile as sf

    label = _label(source, name)
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    except OSError as e:
        raise AudioError(f"{label}: cannot read: {e.strerror or e}") from None
    if not data:
        raise AudioError(f"{label}: empty file, not audio")
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        why = " ".join(str(e).split(": ", 1)[-1].split()) or type(e).__name__
        if "SF_INFO struct incomplete" in why:  # libsndfile's word for a 0 Hz or 0-channel header
            raise AudioError(f"{label}: the header has no usable sample rate or channel count (0 Hz?)") from None
        raise AudioError(f"{label}: not audio, or a format or codec libsndfile cannot decode ({why})") from None
    with f:
        rate, channels = int(f.samplerate), int(f.channels)
        _check_header(label, rate, channels, int(f.frames) if f.frames >= 0 else None)
        return _decode(f, label, rate, channels)


def _decode(f, label: str, rate: int, channels: int) -> AudioInput:
    import soundfile as sf

    stream = None
    if rate != SAMPLE_RATE:
        import soxr
        stream = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
    cap, read, out = MAX_SECONDS * rate, 0, []
    try:
        while True:
            block = f.read(READ_BLOCK, dtype=_read_dtype(f.subtype), always_2d=True)
            if block.shape[0] == 0:
                break
            read += block.shape[0]
            if read > cap:
                raise AudioError(f"{label}: over the {_limit()}")
            x = _mono_float(block)
            out.append(stream.resample_chunk(x) if stream is not None else x)
        if stream is not None:
            out.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
    except sf.LibsndfileError as e:
        raise AudioError(f"{label}: cannot decode ({' '.join(str(e).split())})") from None
    except AudioError as e:
        raise AudioError(str(e) if str(e).startswith(label) else f"{label}: {e}") from None
    x = np.concatenate(out) if out else np.zeros(0, np.float32)
    return _finish(x, label, rate, channels)

