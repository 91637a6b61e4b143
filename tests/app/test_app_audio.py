"""The app's audio input (issue 23): attach by `/audio PATH`, F9, the palette or a lone path; chips
with name, duration and tokens; copies in the data folder sent on every turn; the reopened
history's chips; exports carry the clips; recording from the microphone through a fake input
stream (level meter and elapsed time on the chip); one-line refusals with nothing changed. On the
scripted FakeClient (tests/app_fakes.py), which decodes and counts clips as the real client does.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sf = pytest.importorskip("soundfile")

from app.recorder import NO_PORTAUDIO, NO_SOUNDDEVICE, Recorder, RecorderError  # noqa: E402
from app.screens.dialogs import TextPrompt  # noqa: E402
from app.widgets.attachments import AttachmentBar, AttachmentChip, MediaChips, RecordingChip  # noqa: E402
from app.widgets.message_view import MessageView  # noqa: E402
from app.widgets.status_panel import StatusPanel  # noqa: E402
from tests.app_fakes import FakeBackend, FakeClient  # noqa: E402
from tests.app.test_app import SIZE, make_app, on_screen, open_chat, until  # noqa: E402
from tests.app.test_app_images import notes, type_and_enter, wait_answer  # noqa: E402


def clip(path: Path, seconds: float = 1.0, rate: int = 16000, fmt: str | None = None) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format=fmt,
             subtype=None if fmt == "MP3" else "PCM_16")
    return path


class FakeStream:
    """sounddevice.InputStream's part the recorder uses; the test feeds blocks through `feed`."""
    made: list = []

    def __init__(self, samplerate, channels, dtype, callback):
        self.samplerate, self.callback, self.started, self.closed = samplerate or 48000, callback, False, False
        FakeStream.made.append(self)

    def start(self):
        self.started = True

    def stop(self):
        self.started = False

    def close(self):
        self.closed = True

    def feed(self, seconds: float, amplitude: float, blocks: int = 10):
        n = int(seconds * self.samplerate)
        t = np.arange(n) / self.samplerate
        x = (amplitude * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
        for part in np.array_split(x, blocks):
            self.callback(part[:, None], len(part), None, None)


async def test_audio_command_chip_send_copy_and_reopened_history(tmp_path):
    wav = clip(tmp_path / "question.wav", 1.0)
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/audio {wav}")
        bar = chat.query_one(AttachmentBar)
        assert [(a.kind, a.name, a.n_tokens, round(a.seconds, 2)) for a in bar.pending] == \
            [("audio", "question.wav", 25, 1.0)]
        chip = chat.query_one(AttachmentChip)
        assert str(chip.query_one(".chip-info").render()) == "1.0 s · 25 tok"
        assert str(chip.query_one(".preview").render()) == "♪"
        await pilot.pause(0.6)
        assert "attached 1: 25 tokens" in str(chat.query_one(StatusPanel).render())

        await type_and_enter(pilot, "What did I ask?")
        await wait_answer(pilot, chat, 2)
        assert chat.messages[1].content.startswith("Hello **world**")  # streamed as usual
        sha = hashlib.sha256(wav.read_bytes()).hexdigest()
        copy = tmp_path / "data" / "audio" / f"{sha}.wav"
        assert copy.read_bytes() == wav.read_bytes()
        user = app.store.messages(chat.conversation_id)[0]
        assert user.audio == [{"file": f"{sha}.wav", "name": "question.wav", "bytes": wav.stat().st_size,
                               "tokens": 25, "seconds": 1.0}] and user.images == []
        msgs, _ = app.backend.client.submitted[0]
        assert msgs == [{"role": "user", "content": "What did I ask?", "audio": [str(copy)]}]
        await pilot.pause(0.6)
        panel = str(chat.query_one(StatusPanel).render())
        assert "audio   yes" in panel and "last prompt 25 audio tokens" in panel

        wav.unlink()  # the next turn still sends the copy
        await type_and_enter(pilot, "Again?")
        await wait_answer(pilot, chat, 4)
        assert [m.get("audio") for m in app.backend.client.submitted[1][0]] == [[str(copy)], None, None]
        conversation = chat.conversation_id

    app = make_app(tmp_path)  # reopened: the history shows the clip's chip
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert chat.conversation_id == conversation
        first = chat.query(MessageView).first()
        assert str(first.query_one(MediaChips).render()) == "♪ question.wav · 1.0 s · 25 tok"


async def test_f9_palette_and_a_pasted_path_attach_clips_beside_an_image_and_edit_brings_them_back(tmp_path):
    from tests.app.test_app_images import png

    a = clip(tmp_path / "a.flac", 0.5)
    b = clip(tmp_path / "my memo.mp3", 2.0, 44100, "MP3")
    c = clip(tmp_path / "c.wav", 1.53)
    picture = png(tmp_path / "p.png")
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        bar = chat.query_one(AttachmentBar)
        await pilot.press("f9")  # the key
        await on_screen(pilot, TextPrompt)
        app.screen.query_one("Input").value = str(a)
        await pilot.press("enter")
        await until(pilot, lambda: len(bar.pending) == 1)
        next(cmd for cmd in app.get_system_commands(chat) if cmd.title == "Attach audio").callback()  # the palette
        await on_screen(pilot, TextPrompt)
        app.screen.query_one("Input").value = f"'{b}'"
        await pilot.press("enter")
        await until(pilot, lambda: len(bar.pending) == 2)
        await type_and_enter(pilot, str(c))  # a message that is only a path
        await type_and_enter(pilot, f"/image {picture}")
        await until(pilot, lambda: len(bar.pending) == 4)
        assert [(p.kind, p.n_tokens) for p in bar.pending][:3] == [("audio", 13), ("audio", bar.pending[1].n_tokens),
                                                                   ("audio", 38)]
        assert bar.pending[1].n_tokens >= 50  # 2 s of MP3 (its decoder adds a little)
        await pilot.press("shift+f3")  # removes the last one: the image
        await until(pilot, lambda: len(bar.pending) == 3)
        await type_and_enter(pilot, "Compare them.")
        await wait_answer(pilot, chat, 2)
        msgs, _ = app.backend.client.submitted[0]
        assert len(msgs[0]["audio"]) == 3 and "images" not in msgs[0]
        assert app.backend.client.audio_tokens == sum(r["tokens"] for r in app.store.messages(chat.conversation_id)[0].audio)
        await pilot.press("ctrl+l")  # edit the last message: the clips come back as chips
        await until(pilot, lambda: len(bar.pending) == 3)
        assert [p.name for p in bar.pending] == ["a.flac", "my memo.mp3", "c.wav"]


async def test_a_recording_through_a_fake_stream_shows_time_and_level_and_is_attached(tmp_path):
    app = make_app(tmp_path)
    FakeStream.made.clear()
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        chat.recorder_factory = lambda: Recorder(stream_factory=FakeStream, samplerate=48000)
        await pilot.press("f5")
        await until(pilot, lambda: chat.query(RecordingChip))
        stream = FakeStream.made[-1]
        assert stream.started
        stream.feed(1.0, 0.5)  # -9 dBFS of tone
        await pilot.pause(0.3)
        info = str(chat.query_one(RecordingChip).query_one(".rec-info").render())
        assert info.startswith("1.0 s ") and info.count("█") == 6, info  # (1 - 9/60)·8 = 6.8 cells
        stream.feed(0.5, 0.0)  # then silence: the meter drops
        await pilot.pause(0.3)
        info = str(chat.query_one(RecordingChip).query_one(".rec-info").render())
        assert info == "1.5 s ········", info
        await pilot.press("f5")  # stop: the clip is attached like a file
        bar = chat.query_one(AttachmentBar)
        await until(pilot, lambda: len(bar.pending) == 1 and not chat.query(RecordingChip))
        rec = bar.pending[0]
        assert stream.closed and rec.kind == "audio" and rec.name.startswith("recording-") and rec.ext == ".wav"
        assert (round(rec.seconds, 2), rec.n_tokens) == (1.5, 38)
        await type_and_enter(pilot, "Transcribe it.")
        await wait_answer(pilot, chat, 2)
        kept = app.store.messages(chat.conversation_id)[0].audio[0]
        assert kept["name"] == rec.name and kept["seconds"] == 1.5
        assert sf.info(str(app.store.audio_path(kept))).samplerate == 48000  # the device's own rate, kept


async def test_recording_without_sounddevice_or_a_microphone_is_one_line(tmp_path, monkeypatch):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        monkeypatch.setitem(sys.modules, "sounddevice", None)  # not installed: import fails
        await pilot.press("f5")
        await pilot.pause(0.2)
        assert notes(app)[-1] == NO_SOUNDDEVICE and chat.recorder is None and not chat.query(RecordingChip)

        class NoMic:  # installed, PortAudio there, no input device
            class PortAudioError(Exception):
                pass

            @staticmethod
            def query_devices(kind=None):
                raise ValueError("No input device matching")
        monkeypatch.setitem(sys.modules, "sounddevice", NoMic)
        await pilot.press("f5")
        await pilot.pause(0.2)
        assert notes(app)[-1] == "No microphone: no audio input device was found"
        assert not chat.query_one(AttachmentBar).pending and not chat.query(RecordingChip)


def test_portaudio_missing_is_said_in_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_portaudio(name, *a, **k):
        if name == "sounddevice":
            raise OSError("PortAudio library not found")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_portaudio)
    with pytest.raises(RecorderError) as e:
        Recorder().start()
    assert str(e.value) == NO_PORTAUDIO


@pytest.mark.parametrize("case", ["junk", "short", "deaf"])
async def test_bad_clips_are_refused_in_one_line_and_nothing_changes(tmp_path, case):
    path = tmp_path / "bad.wav"
    if case == "junk":
        path.write_text("not a recording")
    else:
        clip(path, 0.005)  # 5 ms: under one token
    app = make_app(tmp_path, FakeBackend(FakeClient(audio=case != "deaf")))
    if case == "deaf":
        clip(path, 1.0)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/audio {path}")
        await pilot.pause(0.2)
        line = notes(app)[-1]
        assert "\n" not in line and {"junk": "not audio", "short": "too short", "deaf": "takes no audio"}[case] in line
        assert chat.query_one("#input").text == f"/audio {path}" and not chat.query_one(AttachmentBar).pending
        if case == "deaf":
            await pilot.press("f5")
            await pilot.pause(0.2)
            assert "takes no audio" in notes(app)[-1] and not chat.query(RecordingChip)


async def test_an_export_carries_the_clips_and_imports_back(tmp_path):
    wav = clip(tmp_path / "memo.wav", 1.0)
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/audio {wav}")
        await type_and_enter(pilot, "Summarise.")
        await wait_answer(pilot, chat, 2)
        await pilot.press("f4")
        await pilot.pause(0.2)
        assert "audio in" in notes(app)[-1]
        md = next(app.export_dir.glob("*.md"))
        sha = hashlib.sha256(wav.read_bytes()).hexdigest()
        assert (app.export_dir / f"{md.stem}-audio" / f"{sha}.wav").read_bytes() == wav.read_bytes()
        assert f"[▶ memo.wav · 1.0 s]({md.stem}-audio/{sha}.wav)" in md.read_text()
        doc = json.loads(md.with_suffix(".json").read_text())
        assert doc["version"] == 4 and doc["messages"][0]["audio"][0]["file"] == f"{md.stem}-audio/{sha}.wav"
        conv = app.store.import_file(md.with_suffix(".json"))
        assert app.store.messages(conv.id)[0].audio[0]["seconds"] == 1.0
