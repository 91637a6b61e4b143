"""`edgegem chat`: the plain line-by-line chat (no full-screen UI, no saved history), with `/image
PATH` and `/audio PATH` lines. Registered by app/cli.py, whose engine and sampling flags it shares."""
from __future__ import annotations

import sys
from pathlib import Path

COMMANDS = {"/image": "images", "/audio": "audio"}  # line command -> the message key it fills

# What an answer the engine ended with an error means here, by its kind (engine.request.ErrorKind's
# values: `edgegem --help` imports this module, and the engine, torch with it, only comes in
# cmd_chat; app/server/errors.py maps the same kinds to HTTP statuses). The engine serves on after any
# of them (a failed step frees its KV), so the chat goes on: the failed turn leaves the history,
# and the advice says whether sending it again can work.
ERROR_ADVICE = {
    "bad_input": "the message was refused for its content (an attachment the model cannot take): "
                 "fix it and send it again",
    "capacity": "the conversation no longer fits the KV cache: send something shorter, or start again "
                "with --context-overflow truncate (drops the oldest turns), a larger --gpu-memory-budget "
                "or 8-bit KV (--kv-cache-dtype int8_per_token_head)",
    "out_of_memory": "the device ran out of memory during this answer, which can pass: send the message "
                     "again (the line above says what to lower if it repeats)",
    "internal": "a fault in edgegem, not in your message: please report it with the line above; "
                "you can go on chatting",
}


def error_advice(kind) -> str:
    """The line under `[error: ...]` for an ErrorKind (None, an error without a kind: internal)."""
    return ERROR_ADVICE[kind.value if kind is not None else "internal"]


def _chat_media(lm, command: str, arg: str, budget: int) -> list:
    """`/image PATH` or `/audio PATH` in `edgegem chat`: the item (ImageInput / AudioInput) for the
    next message, or a one-line refusal on stderr and nothing."""
    from engine import api

    from .attachments import path_of
    if not arg:
        print(f"edgegem: usage: {command} PATH", file=sys.stderr)
        return []
    path = path_of(arg) or Path(arg).expanduser()
    if not path.is_file():
        print(f"edgegem: {path.name or arg}: no such file", file=sys.stderr)
        return []
    try:
        if command == "/image":
            (item,) = api.load_images(lm, [str(path)], budget)
            what = f"{item.n_tokens} image tokens"
        else:
            (item,) = api.load_audio(lm, [str(path)])
            what = f"{item.seconds:.1f} s, {item.n_tokens} audio tokens"
    except ValueError as e:
        print(f"edgegem: {str(e).splitlines()[0]}", file=sys.stderr)
        return []
    print(f"[{item.name}: {what}, sent with your next message]")
    return [item]


def cmd_chat(a) -> int:
    """Plain line chat (no full-screen UI, no saved history); the history stays in the prefix cache."""
    from engine import api

    from .cli_chat_tools import asker, open_toolbox, reply_with_tools
    from .cli_options import _device, _emit, _engine_options, _generation, _kv_note, _kv_path, _start_client
    path = api.resolve_model(a.model)
    print(f"edgegem: plain terminal chat on {path.name} (run `edgegem` for the full-screen app).")
    if a.model is None:
        print("This is the bundled demo model, Gemma 3 270M: a small base model that rambles. "
              "Load a Gemma-4 GGUF with --model PATH for real answers.")
    print("Type a message and press Enter; `/image PATH` or `/audio PATH` attaches a file to the next one; an "
          "empty line or Ctrl-D quits.\n")
    lm = api.open_model(path, exact=False, device=_device(a), embed_weights=a.embed_weights, mmproj=a.mmproj,
                        options=_engine_options(a))
    # --image / --audio: refused in one line before the engine starts
    pending = {"images": api.load_images(lm, a.image, a.image_tokens), "audio": api.load_audio(lm, a.audio)}
    client = _start_client(lm, _engine_options(a))
    # a base model (the demo): the conversation is one text it continues, with its defaults where no
    # flag is given (engine/request_params.py), as the app does
    base = api.model_kind(lm)[0] == "base"
    gen = _generation(a, base, thinking=a.thinking, kv_session=_kv_path(a), image_tokens=a.image_tokens)
    if base:
        print("A base model: your text is continued, not answered"
              + ("; each continuation ends at a blank line.\n" if gen.stop_at_blank_line else ".\n"))
    history = [{"role": "system", "content": a.system}] if a.system else []
    box, policy = (None, None) if base else open_toolbox(a)  # a base model takes no tools
    approve = asker(box, policy, id(history)) if box is not None else None
    try:
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            if not line:
                break
            command = next((c for c in COMMANDS if line == c or line.startswith(c + " ")), None)
            if command is not None:
                pending[COMMANDS[command]] += _chat_media(lm, command, line[len(command):].strip(), a.image_tokens)
                continue
            history.append({"role": "user", "content": line, **{k: v for k, v in pending.items() if v}})
            attached = any(pending.values())
            pending = {"images": [], "audio": []}  # sent or not, they go with this message only
            try:
                rid = client.submit(history, gen)
            except ValueError as e:  # too long for the context, media included: say so, keep chatting
                history.pop()
                print(f"edgegem: {str(e).splitlines()[0]} (not sent{'; attach the files again' * attached})",
                      file=sys.stderr)
                continue
            # the media stay in the history: later turns see them too
            sys.stdout.write("model> ")
            if box is not None:  # the tool loop: calls asked, run, answered until the model answers
                added, _, out = reply_with_tools(client, history, gen, box, approve, _emit, a.max_tool_steps,
                                                 a.tool_choice)
                if out.stopped == "error":
                    print(f"\n[error: {out.error}]", file=sys.stderr)
                    history.pop()
                else:
                    history += added
                sys.stdout.write("\n\n")
                continue
            reply, failed = "", False
            for ev in client.stream(rid):
                reply += ev.text
                _emit(ev.text)
                if ev.finished and ev.error:
                    failed = True
                    print(f"\n[error: {ev.error}]\nedgegem: {error_advice(ev.error_kind)}"
                          f"{' (attach the files again)' * attached}", file=sys.stderr)
                if ev.finished:
                    _kv_note(ev.stats)
            if failed:  # neither the message nor the broken answer is replayed in later turns
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply})
            sys.stdout.write("\n\n")
    finally:
        if box is not None:
            box.close()
        client.close()
        _kv_note({}, client)
    return 0
