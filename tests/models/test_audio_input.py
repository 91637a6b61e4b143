"""Audio decoding (issue 23; spec gemma4-audio.md §8): formats, sample scaling, downmix, the
resampler's quality, and every hostile input refused in one line (models/audio.py, and the API
server's base64 entry in engine/media.py)."""
from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest

sf = pytest.importorskip("soundfile")

from engine.media import audio_from_base64  # noqa: E402
from models.audio import MAX_SECONDS, AudioError, audio_from_samples, load_audio  # noqa: E402


def _encoded(x, rate=16000, fmt="WAV", subtype=None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _tone(f, seconds=1.0, rate=16000, amp=0.5):
    return (amp * np.sin(2 * np.pi * f * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _one_line(e) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# --- formats and scaling -----------------------------------------------------------------------
def test_pcm16_is_scaled_by_2_to_the_15():
    pcm = (np.arange(-1000, 1000, dtype=np.int16) * 30).astype(np.int16)
    clip = load_audio(_encoded(pcm, subtype="PCM_16"), name="a.wav")
    assert np.array_equal(clip.samples.numpy(), pcm.astype(np.float32) / 32768)


@pytest.mark.parametrize("subtype", ["PCM_24", "PCM_32"])
def test_24_and_32_bit_pcm_are_scaled_by_2_to_the_31(subtype):
    pcm = (np.linspace(-0.9, 0.9, 4000) * 2 ** 31).astype(np.int32) & ~0xFF  # 24-bit exact values
    clip = load_audio(_encoded(pcm, subtype=subtype), name="a.wav")
    assert np.allclose(clip.samples.numpy(), pcm / 2 ** 31, atol=1e-7)


def test_float_samples_are_kept_as_stored_and_arrays_take_int16_int32_float():
    x = _tone(440) * 1.5  # over 1.0: no normalisation, no clipping (§8)
    assert np.array_equal(load_audio(_encoded(x, subtype="FLOAT")).samples.numpy(), x)
    pcm = (x / 2 * 32767).astype(np.int16)
    assert np.array_equal(audio_from_samples(pcm, 16000).samples.numpy(), pcm / np.float32(32768))
    assert np.allclose(audio_from_samples(pcm.astype(np.int32) << 16, 16000).samples.numpy(), pcm / 32768)


def test_stereo_is_averaged():
    left, right = _tone(300), _tone(500, amp=0.25)
    clip = load_audio(_encoded(np.stack([left, right], 1), subtype="FLOAT"))
    assert clip.channels == 2 and np.allclose(clip.samples.numpy(), (left + right) / 2, atol=1e-7)


@pytest.mark.parametrize("fmt", ["FLAC", "OGG", "MP3"])
def test_flac_ogg_and_mp3_decode(fmt):
    x = _tone(440, 2.0)
    clip = load_audio(_encoded(x, fmt=fmt), name=f"a.{fmt.lower()}")
    n = clip.samples.shape[0]
    assert abs(n - x.shape[0]) <= (2000 if fmt == "MP3" else 0)  # MP3's encoder delay and padding
    if fmt == "FLAC":
        assert np.allclose(clip.samples.numpy(), x, atol=1 / 32768)  # FLAC stores 16-bit PCM
    else:  # lossy: the tone is still there (its correlation at the best lag)
        y = clip.samples.numpy()
        lags = range(0, 1600, 1) if fmt == "MP3" else [0]
        best = max(abs(np.dot(x[8000:24000], y[8000 + k:24000 + k])) for k in lags if 24000 + k <= n)
        assert best / np.dot(x[8000:24000], x[8000:24000]) > 0.9


def test_the_resampler_keeps_the_passband_and_rejects_aliases():
    """soxr HQ, 44.1 kHz -> 16 kHz: a 1 kHz and a 7 kHz tone keep their level (±0.05 dB), a
    12 kHz tone (it would alias to 4 kHz) is removed (< -90 dB)."""
    def level(clip, f):
        y = clip.samples.numpy()[4000:-4000].astype(np.float64)
        t = np.arange(y.shape[0]) / 16000
        return 20 * np.log10(2 * abs(np.mean(y * np.exp(-2j * np.pi * f * t))) / 0.5)
    for f in (1000, 7000):
        clip = load_audio(_encoded(_tone(f, 2.0, 44100), 44100, subtype="FLOAT"))
        assert abs(clip.samples.shape[0] - 32000) <= 1
        assert abs(level(clip, f)) < 0.05, level(clip, f)
    alias = load_audio(_encoded(_tone(12000, 2.0, 44100), 44100, subtype="FLOAT"))
    assert level(alias, 4000) < -90 and np.abs(alias.samples.numpy()[4000:-4000]).max() < 1e-3


def test_same_sound_same_digest_whatever_the_container():
    pcm = (_tone(330) * 32767).astype(np.int16)
    a = load_audio(_encoded(pcm, subtype="PCM_16"))
    b = load_audio(_encoded(pcm, fmt="FLAC"))
    c = load_audio(_encoded((pcm + 1).astype(np.int16), subtype="PCM_16"))
    assert a.digest == b.digest != c.digest and a.n_tokens == 25


# --- hostile input: a one-line refusal each ---------------------------------------------------
def _wav_with(rate=None, fmt_tag=None):
    d = bytearray(_encoded((_tone(440) * 32767).astype(np.int16), subtype="PCM_16"))
    if rate is not None:
        d[24:28] = struct.pack("<I", rate)
        d[28:32] = struct.pack("<I", rate * 2)
    if fmt_tag is not None:
        d[20:22] = struct.pack("<H", fmt_tag)
    return bytes(d)


@pytest.mark.parametrize("data, said", [
    (b"hello, this is not a recording at all. " * 20, "not audio"),
    (_wav_with(fmt_tag=0x0055), "cannot decode"),  # MP3 inside a WAV: a codec libsndfile does not take
    (b"", "empty"),
    (_encoded(np.zeros(0, np.int16), subtype="PCM_16"), "empty"),
    (_encoded(np.zeros(100, np.int16), subtype="PCM_16"), "too short"),  # 6 ms: under one frame
    (_wav_with(rate=0), "sample rate"),
    (_wav_with(rate=3), "sample rate 3 Hz"),
    (_wav_with(rate=50_000_000), "sample rate 50000000 Hz"),
])
def test_bad_audio_is_refused_in_one_line(data, said):
    with pytest.raises(AudioError) as e:
        load_audio(data, name="clip.wav")
    line = _one_line(e)
    assert line.startswith("clip.wav: ") and said in line, line


def test_a_header_claiming_hours_is_refused_before_decoding(monkeypatch):
    """The decompression-bomb equivalent: a FLAC whose STREAMINFO claims 10 hours (one second
    of data follows) is refused from the header, before a sample is decoded."""
    data = bytearray(_encoded(_tone(440), fmt="FLAC"))
    i = data.index(b"fLaC") + 8  # STREAMINFO body: total samples are 36 bits ending at bit 144
    info = int.from_bytes(data[i:i + 34], "big")
    shift = 34 * 8 - 108 - 36
    info = (info & ~(((1 << 36) - 1) << shift)) | ((16000 * 3600 * 10) << shift)
    data[i:i + 34] = info.to_bytes(34, "big")
    read = []
    monkeypatch.setattr(sf.SoundFile, "read", lambda self, *a, **k: read.append(1))
    with pytest.raises(AudioError) as e:
        load_audio(bytes(data), name="bomb.flac")
    assert "600 minutes" in _one_line(e) and f"{MAX_SECONDS // 60}-minute limit" in str(e.value) and not read


def test_a_header_that_understates_its_length_is_stopped_at_the_cap(monkeypatch):
    """A header that passes the check (here: the check is skipped) is still stopped while
    reading, at MAX_SECONDS (here 1 s) of the file's rate."""
    import models.audio as audio

    monkeypatch.setattr(audio, "MAX_SECONDS", 1)
    monkeypatch.setattr(audio, "READ_BLOCK", 4000)
    monkeypatch.setattr(audio, "_check_header", lambda *a: None)
    with pytest.raises(AudioError) as e:
        load_audio(_encoded(_tone(440, 3.0), subtype="PCM_16"), name="long.wav")
    assert _one_line(e) == "long.wav: over the 1 s limit"


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(AudioError) as e:
        load_audio(tmp_path / "gone.wav")
    assert _one_line(e).startswith("gone.wav: cannot read")


def test_non_finite_samples_are_refused():
    x = _tone(440)
    x[100] = np.nan
    with pytest.raises(AudioError) as e:
        audio_from_samples(x, 16000, name="nan")
    assert "not finite" in _one_line(e)


# --- the API server's entry: base64 wav/mp3 -----------------------------------------------------
def test_base64_wav_and_mp3_decode_like_files():
    wav = _encoded((_tone(440) * 32767).astype(np.int16), subtype="PCM_16")
    a = audio_from_base64(base64.b64encode(wav).decode(), "wav")
    assert a.digest == load_audio(wav).digest and a.name == "input_audio"
    mp3 = _encoded(_tone(440), fmt="MP3")
    assert audio_from_base64("data:audio/mpeg;base64," + base64.b64encode(mp3).decode(), "mp3").n_tokens >= 25


@pytest.mark.parametrize("data, fmt, said", [
    ("!!not base64!!", "wav", "not valid base64"),
    (base64.b64encode(b"plain text, no sound").decode(), "wav", "not audio"),
    ("", "wav", "non-empty base64"),
    (base64.b64encode(b"x").decode(), "aac", "format 'aac' is not one of wav, mp3"),
    ("A" * (90 << 20), "wav", "over the 64 MiB limit"),
])
def test_bad_base64_audio_is_one_line(data, fmt, said):
    with pytest.raises(ValueError) as e:
        audio_from_base64(data, fmt)
    assert said in _one_line(e) and str(e.value).startswith("input_audio: ")
