"""The chat screen's microphone (issue 23): F5 (or the palette) starts a recording, F5 again stops
it and attaches the clip like a file (the same checks, the same chip). While it records, a chip
in the attachment bar shows the elapsed time and a level meter, refreshed ten times a second.

A mixin of `ChatScreen`. Without sounddevice, PortAudio or an input device, F5 says why in one
notification and nothing else changes. `recorder_factory` (a screen attribute) lets tests drive a
fake input stream.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from app.attachments import AttachError, attachment_from_bytes
from app.recorder import Recorder, RecorderError, level_meter
from app.widgets.attachments import RecordingChip

METER_INTERVAL_S = 0.1


class RecordMixin:
    """Needs from the screen: attachments, takes, _refuse, settings, notify, set_interval."""

    recorder: Optional[Recorder] = None
    recorder_factory: Callable[[], Recorder] = Recorder

    async def action_record(self) -> None:
        """Start recording, or stop and attach what was recorded."""
        if self.recorder is not None and self.recorder.recording:
            await self.stop_recording()
            return
        if not self.takes("audio"):
            from app.screens.chat_media import NO_ENCODER
            self._refuse(NO_ENCODER["audio"], "audio")
            return
        recorder = self.recorder_factory()
        try:
            recorder.start()
        except RecorderError as e:
            self._refuse(str(e), "audio")
            return
        self.recorder = recorder
        self._rec_chip = RecordingChip()
        bar = self.attachments
        bar.display = True
        await bar.mount(self._rec_chip)
        self._rec_timer = self.set_interval(METER_INTERVAL_S, self._show_recording)

    async def _show_recording(self) -> None:
        r = self.recorder
        if r is None or not r.recording:
            return
        if r.full:  # the cap: stop by itself and attach what there is
            await self.stop_recording()
            return
        self._rec_chip.show(r.elapsed, level_meter(r.level))

    def on_unmount(self) -> None:
        """Leaving (quitting) while recording: the microphone is released, nothing is attached."""
        if self.recorder is not None:
            self.recorder.stop()
            self.recorder = None

    async def stop_recording(self) -> bool:
        """Stop the microphone and attach the recording (False: nothing attached, said why)."""
        r, self.recorder = self.recorder, None
        if r is None:
            return False
        self._rec_timer.stop()
        await self._rec_chip.remove()
        bar = self.attachments
        bar.display = bool(bar.pending)
        name = time.strftime("recording-%Y%m%d-%H%M%S.wav")
        try:
            attachment = attachment_from_bytes(r.wav(), name, int(self.settings["image_tokens"]), "audio", ".wav")
        except AttachError as e:  # e.g. stopped at once: under one token of sound
            self._refuse(str(e), "audio")
            return False
        await bar.add(attachment)
        return True
