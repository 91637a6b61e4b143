"""The app's image input (issue 15): attach by `/image PATH`, F3, the palette or a lone path;
chips with name, size, tokens and a preview; copies in the data folder sent on every turn; the
history's chips; hostile images refused in one line with nothing changed; the engine's refusal on
submit shown in one line with the images kept. On the scripted FakeClient (tests/app_fakes.py),
which opens and counts images as the real client does; one test runs the tiny multimodal model.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from PIL import Image

from app.screens.chat import ChatScreen
from app.screens.dialogs import TextPrompt
from app.widgets.attachments import AttachmentBar, AttachmentChip, ImageChips
from app.widgets.message_view import MessageView
from app.widgets.status_panel import StatusPanel
from engine.env import reload
from engine.scheduler import ContextOverflowError
from tests.app_fakes import FakeBackend, FakeClient
from tests.app.test_app import SIZE, make_app, on_screen, open_chat, until

# A 40x30 image at the default 280-token budget is resized to 912x672: 19x14 = 266 soft tokens.
TOKENS_40x30 = 266


def png(path: Path, size=(40, 30), color=(200, 30, 30), fmt: str = "PNG") -> Path:
    Image.new("RGB", size, color).save(path, fmt)
    return path


def notes(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def type_and_enter(pilot, text: str) -> None:
    box = pilot.app.screen.query_one("#input")
    box.text = text
    box.focus()
    await pilot.press("enter")
    await pilot.pause()


async def wait_answer(pilot, chat: ChatScreen, n_messages: int) -> None:
    await until(pilot, lambda: chat.gen is None and len(chat.messages) == n_messages)


async def test_image_command_chip_send_copy_and_reopened_history(tmp_path):
    cat = png(tmp_path / "cat.png")
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/image {cat}")
        bar = chat.query_one(AttachmentBar)
        assert [(a.name, a.size, a.n_tokens) for a in bar.pending] == [("cat.png", cat.stat().st_size, TOKENS_40x30)]
        assert chat.query_one("#input").text == "" and bar.display  # attached: the command is gone
        chip = chat.query_one(AttachmentChip)
        assert str(chip.query_one(".chip-name").render()) == "cat.png"
        assert f"· {TOKENS_40x30} tok" in str(chip.query_one(".chip-info").render())
        assert "▀" in str(chip.query_one(".preview").render())  # the half-block picture
        await pilot.pause(0.6)
        assert f"attached 1: {TOKENS_40x30} tokens" in str(chat.query_one(StatusPanel).render())
        assert not app.backend.client.submitted and not app.store.messages(chat.conversation_id)

        await type_and_enter(pilot, "What is in this picture?")
        await wait_answer(pilot, chat, 2)
        assert chat.messages[1].content.startswith("Hello **world**")  # streamed as usual
        assert not bar.pending and not bar.display
        sha = hashlib.sha256(cat.read_bytes()).hexdigest()
        copy = tmp_path / "data" / "images" / f"{sha}.png"
        assert copy.read_bytes() == cat.read_bytes()
        user = app.store.messages(chat.conversation_id)[0]
        assert user.images == [{"file": f"{sha}.png", "name": "cat.png", "bytes": cat.stat().st_size,
                                "tokens": TOKENS_40x30}]
        msgs, params = app.backend.client.submitted[0]
        assert msgs == [{"role": "user", "content": "What is in this picture?", "images": [str(copy)]}]
        assert params.image_tokens == 280
        await pilot.pause(0.6)
        assert f"last prompt {TOKENS_40x30} image tokens" in str(chat.query_one(StatusPanel).render())

        cat.unlink()  # the original goes away: the next turn still sends the copy
        await type_and_enter(pilot, "And its colour?")
        await wait_answer(pilot, chat, 4)
        msgs, _ = app.backend.client.submitted[1]
        assert [m.get("images") for m in msgs] == [[str(copy)], None, None]
        conversation = chat.conversation_id

    app = make_app(tmp_path)  # reopened: the history shows the chip
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        assert chat.conversation_id == conversation
        first = chat.query(MessageView).first()
        assert first.role == "user" and first.images[0]["name"] == "cat.png"
        text = str(first.query_one(ImageChips).render())
        assert "cat.png" in text and f"{TOKENS_40x30} tok" in text and " B" in text


async def test_f3_palette_and_a_pasted_path_attach_several_images_and_they_can_be_removed(tmp_path):
    a = png(tmp_path / "a.png")
    b = png(tmp_path / "my photo.jpg", (30, 40), (10, 200, 10), "JPEG")
    c = png(tmp_path / "c.png", (80, 80), (0, 0, 255))
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        bar = chat.query_one(AttachmentBar)
        await pilot.press("f3")  # the key
        await on_screen(pilot, TextPrompt)
        app.screen.query_one("Input").value = str(a)
        await pilot.press("enter")
        await until(pilot, lambda: len(bar.pending) == 1)

        next(cmd for cmd in app.get_system_commands(chat) if cmd.title == "Attach image").callback()  # the palette
        await on_screen(pilot, TextPrompt)
        app.screen.query_one("Input").value = f"'{b}'"  # quoted, as a file manager pastes it
        await pilot.press("enter")
        await until(pilot, lambda: len(bar.pending) == 2)

        await type_and_enter(pilot, str(c).replace(" ", "\\ "))  # a message that is only a path
        await until(pilot, lambda: len(bar.pending) == 3)
        assert chat.query_one("#input").text == "" and not app.backend.client.submitted
        assert [x.name for x in bar.pending] == ["a.png", "my photo.jpg", "c.png"]
        assert bar.pending[1].ext == ".jpg" and bar.pending[2].n_tokens == 256  # a square at 280

        await pilot.click(chat.query(AttachmentChip)[0].query_one(".remove"))  # the chip's ✕
        await until(pilot, lambda: len(bar.pending) == 2)
        await pilot.press("shift+f3")  # the key removes the last one
        await until(pilot, lambda: len(bar.pending) == 1)
        await type_and_enter(pilot, str(c))
        await until(pilot, lambda: len(bar.pending) == 2)
        await next(cmd for cmd in app.get_system_commands(chat) if cmd.title == "Remove attachment").callback()
        await until(pilot, lambda: len(bar.pending) == 1)
        assert [x.name for x in bar.pending] == ["my photo.jpg"] and len(chat.query(AttachmentChip)) == 1

        await pilot.press("f3")
        await on_screen(pilot, TextPrompt)
        app.screen.query_one("Input").value = str(a)
        await pilot.press("enter")
        await until(pilot, lambda: len(bar.pending) == 2)
        await type_and_enter(pilot, "")  # images alone are a message
        await wait_answer(pilot, chat, 2)
        msgs, _ = app.backend.client.submitted[0]
        assert msgs[0]["content"] == "" and len(msgs[0]["images"]) == 2
        assert app.store.get(chat.conversation_id).title == "my photo.jpg"
        assert [im["name"] for im in chat.messages[0].images] == ["my photo.jpg", "a.png"]
        assert len(list((tmp_path / "data" / "images").iterdir())) == 2

        await pilot.press("ctrl+l")  # edit the last message: its images come back as chips
        await until(pilot, lambda: len(bar.pending) == 2)
        assert [x.name for x in bar.pending] == ["my photo.jpg", "a.png"] and not chat.messages


def _bomb(path: Path) -> Path:
    Image.new("1", (10_000, 10_000)).save(path)  # 100 M pixels over Pillow's 89 M cap, ~12 KB of PNG
    return path


HOSTILE = {  # name -> (make the file, what the one line says)
    "not an image": (lambda p: (p / "notes.png").write_text("just text") and p / "notes.png", "not an image"),
    "unsupported format": (lambda p: (p / "logo.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
                           and p / "logo.svg", "format Pillow cannot read"),
    "decompression bomb": (lambda p: _bomb(p / "bomb.png"), "decompression bomb"),
    "zero-size file": (lambda p: (p / "empty.png").write_bytes(b"") or p / "empty.png", "empty file"),
    "1-pixel image": (lambda p: png(p / "dot.png", (1, 1)), "too small"),
    "no such file": (lambda p: p / "gone.png", "no such file"),
}


@pytest.mark.parametrize("how", ["command", "path"])
@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_image_is_refused_in_one_line_and_nothing_changes(tmp_path, name, how):
    make, expected = HOSTILE[name]
    path = make(tmp_path)
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        text = f"/image {path}" if how == "command" else str(path)
        before = len(notes(app))
        await type_and_enter(pilot, text)
        await pilot.pause(0.1)
        if how == "path" and name == "no such file":
            # a path that does not exist is not taken for an image: it is sent as text
            await wait_answer(pilot, chat, 2)
            assert app.backend.client.submitted[0][0][0]["content"] == str(path)
            return
        new = notes(app)[before:]
        assert len(new) == 1 and "\n" not in new[0] and expected in new[0], new
        assert chat.query_one("#input").text == text  # kept for the user to fix
        assert not chat.query_one(AttachmentBar).pending and not chat.query(AttachmentChip)
        assert not app.backend.client.submitted and not app.store.messages(chat.conversation_id)
        assert not (tmp_path / "data" / "images").exists()


async def test_a_model_without_a_vision_encoder_refuses_images(tmp_path):
    cat = png(tmp_path / "cat.png")
    app = make_app(tmp_path, FakeBackend(FakeClient(images=False)))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/image {cat}")
        new = [n for n in notes(app) if "image" in n.lower()]
        assert len(new) == 1 and "no vision encoder" in new[0]
        assert chat.query_one("#input").text == f"/image {cat}" and not chat.query_one(AttachmentBar).pending
        await pilot.pause(0.6)
        assert "images  no (no vision encoder)" in str(chat.query_one(StatusPanel).render())


async def test_too_many_image_tokens_for_the_context_is_one_line_and_the_images_stay(tmp_path):
    cat = png(tmp_path / "cat.png")
    error = ContextOverflowError("prompt of 5000 tokens (4900 of them for 4 images) does not fit the "
                                 "4096-token context")
    app = make_app(tmp_path, FakeBackend(FakeClient(submit_error=error)))
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/image {cat}")
        await type_and_enter(pilot, "describe")
        await wait_answer(pilot, chat, 2)
        failed = [n for n in notes(app) if "does not fit" in n]
        assert failed == [str(error)]
        user, answer = app.store.messages(chat.conversation_id)
        assert user.images[0]["name"] == "cat.png" and answer.status == "error"
        assert (tmp_path / "data" / "images" / user.images[0]["file"]).exists()
        await pilot.press("ctrl+l")  # back into the input with its image, to drop some and resend
        await until(pilot, lambda: len(chat.query_one(AttachmentBar).pending) == 1)
        assert chat.query_one("#input").text == "describe"


async def test_export_and_import_carry_the_images(tmp_path):
    cat = png(tmp_path / "cat.png")
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/image {cat}")
        await type_and_enter(pilot, "what is it")
        await wait_answer(pilot, chat, 2)
        await pilot.press("f4")
        await pilot.pause()
        exports = tmp_path / "data" / "exports"
        md = next(exports.glob("*.md"))
        folder = exports / f"{md.stem}-images"
        (copy,) = folder.iterdir()
        assert copy.read_bytes() == cat.read_bytes()
        assert f"![cat.png]({folder.name}/{copy.name})" in md.read_text()
        assert any(f"images in {folder.name}/" in n for n in notes(app))


# --- the chip's preview: textual-image where the terminal has graphics, half blocks elsewhere ----

async def test_image_chip_preview_draws_through_textual_image_when_the_terminal_has_graphics(tmp_path, monkeypatch):
    """The kitty-protocol widget of textual-image (what a kitty/Ghostty terminal gets), forced:
    a pilot terminal answers no graphics query. It holds the image itself, in the chip's 8x3 cells."""
    pytest.importorskip("textual_image")
    from textual_image.widget import TGPImage

    from app.widgets import image_preview
    monkeypatch.setattr(image_preview, "GRAPHICS", TGPImage)
    assert image_preview.protocol() == "kitty"
    cat = png(tmp_path / "cat.png", size=(48, 32), color=(10, 120, 200))
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/image {cat}")
        chip = chat.query_one(AttachmentChip)
        await pilot.pause(0.2)
        (picture,) = chip.query(TGPImage)
        assert picture.image.size == (48, 32) and picture.image.getpixel((5, 5)) == (10, 120, 200)
        assert (picture.size.width, picture.size.height) == image_preview.PREVIEW_CELLS
        assert not chip.query(".preview").exclude(".graphic")  # no half-block picture beside it


async def test_image_chip_preview_falls_back_to_half_blocks_without_graphics(tmp_path, monkeypatch):
    from rich.text import Text
    from textual.widgets import Static

    from app.widgets import image_preview
    monkeypatch.setattr(image_preview, "GRAPHICS", None)
    cat = png(tmp_path / "cat.png", color=(10, 120, 200))
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        chat = await open_chat(pilot)
        await type_and_enter(pilot, f"/image {cat}")
        (preview,) = chat.query_one(AttachmentChip).query(".preview")
        assert isinstance(preview, Static) and isinstance(preview.content, Text)
        assert "▀" in preview.content.plain


def test_graphics_detection_follows_textual_image_and_can_be_turned_off(monkeypatch):
    """textual-image's pick for this terminal -> our widget: sixel and kitty draw the picture, its
    half-cell and unicode picks leave ours; EDGEGEM_IMAGE_PREVIEW=blocks forces ours."""
    pytest.importorskip("textual_image")
    from textual_image import renderable
    from textual_image.widget import SixelImage, TGPImage

    from app.widgets import image_preview
    for picked, want in ((renderable.TGPImage, TGPImage), (renderable.SixelImage, SixelImage),
                         (renderable.HalfcellImage, None), (renderable.UnicodeImage, None)):
        monkeypatch.setattr(renderable, "Image", picked)
        assert image_preview._graphics_widget() is want
    monkeypatch.setattr(renderable, "Image", renderable.TGPImage)
    monkeypatch.setenv("EDGEGEM_IMAGE_PREVIEW", "blocks")
    reload()
    assert image_preview._graphics_widget() is None
