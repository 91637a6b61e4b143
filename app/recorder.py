"""Recording from the microphone into a clip for the next message (no Textual in this file).

`Recorder` wraps a `sounddevice.InputStream` (PortAudio) at the input device's own rate, mono
float32; the engine resamples to 16 kHz like any file. PortAudio calls `_on_block` from its own
thread, so the blocks and the level go through a lock; the UI reads `level` and `elapsed` from a
timer. sounddevice is optional at run time: without it, without PortAudio or without an input
device `start` raises a one-line RecorderError. Tests pass `stream_factory` (a fake InputStream)
and feed blocks themselves.
"""
from __future__ import annotations

import io
import math
import threading
from typing import Callable, Optional

import numpy as np

MAX_RECORD_SECONDS = 10 * 60  # stops by itself there: 15,000 tokens (longer audio: attach a file)
NO_SOUNDDEVICE = "Recording needs the sounddevice package: pip install 'edgegem[mic]'"
NO_PORTAUDIO = "Recording needs the PortAudio library (on Linux: the libportaudio2 package)"


class RecorderError(RuntimeError):
    """One line: why recording cannot start."""


def _default_stream(**kw):
    try:
        import sounddevice as sd
    except ImportError:
        raise RecorderError(NO_SOUNDDEVICE) from None
    except OSError:  # the package is there, the PortAudio library is not
        raise RecorderError(NO_PORTAUDIO) from None
    try:
        device = sd.query_devices(kind="input")
    except (sd.PortAudioError, ValueError):
        raise RecorderError("No microphone: no audio input device was found") from None
    return sd.InputStream(samplerate=kw.pop("samplerate", None) or float(device["default_samplerate"]), **kw)


class Recorder:
    def __init__(self, stream_factory: Optional[Callable[..., object]] = None, samplerate: Optional[int] = None,
                 max_seconds: float = MAX_RECORD_SECONDS):
        self._factory = stream_factory or _default_stream
        self._rate_wanted, self.max_seconds = samplerate, max_seconds
        self._lock = threading.Lock()
        self._blocks: list[np.ndarray] = []
        self._frames, self._level = 0, 0.0
        self.stream = None
        self.rate = 0

    @property
    def recording(self) -> bool:
        return self.stream is not None

    def start(self) -> None:
        """Open and start the input stream (RecorderError: one line, nothing started)."""
        self._blocks, self._frames, self._level = [], 0, 0.0
        try:
            stream = self._factory(samplerate=self._rate_wanted, channels=1, dtype="float32", callback=self._on_block)
            self.rate = int(getattr(stream, "samplerate", None) or self._rate_wanted or 16000)  # before any block
            stream.start()
        except RecorderError:
            raise
        except Exception as e:  # noqa: BLE001 - PortAudio's errors (device busy, bad rate) as one line
            raise RecorderError(f"Cannot record: {' '.join(str(e).split()) or type(e).__name__}") from None
        self.stream = stream

    def _on_block(self, indata, frames, time_info, status) -> None:
        """PortAudio's thread: keep a copy of the block, and its level."""
        block = np.array(indata, dtype=np.float32).reshape(-1)
        rms = float(np.sqrt(np.mean(block.astype(np.float64) ** 2))) if block.size else 0.0
        with self._lock:
            if self._frames >= self.max_seconds * max(self.rate, 1):
                return
            self._blocks.append(block)
            self._frames += block.size
            self._level = rms

    @property
    def elapsed(self) -> float:
        with self._lock:
            return self._frames / self.rate if self.rate else 0.0

    @property
    def full(self) -> bool:
        """The cap is reached: the UI stops and attaches what there is."""
        return self.elapsed >= self.max_seconds

    @property
    def level(self) -> float:
        """0..1 on a dB scale: -60 dBFS (silence) -> 0, 0 dBFS -> 1."""
        with self._lock:
            rms = self._level
        return 0.0 if rms <= 1e-3 else min(1.0, 1.0 + 20 * math.log10(rms) / 60)

    def stop(self) -> tuple[np.ndarray, int]:
        """Stop and close the stream; the samples (float32 [L]) and their rate."""
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                stream.stop()
            finally:
                stream.close()
        with self._lock:
            samples = np.concatenate(self._blocks) if self._blocks else np.zeros(0, np.float32)
            self._blocks = []
        return samples, self.rate

    def wav(self) -> bytes:
        """Stop, and the recording as a 16-bit PCM WAV file's bytes (what is attached and kept)."""
        import soundfile as sf

        samples, rate = self.stop()
        buf = io.BytesIO()
        sf.write(buf, np.clip(samples, -1.0, 1.0), rate or 16000, format="WAV", subtype="PCM_16")
        return buf.getvalue()


def level_meter(level: float, width: int = 8) -> str:
    """A bar of `width` cells for a 0..1 level: full cells, a half cell, dots: "███▄····"."""
    full = level * width
    return "".join("█" if i + 1 <= full else "▄" if i < full else "·" for i in range(width))
