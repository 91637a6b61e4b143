"""`edgegem run`, `score` and `tokenize`: one reply to stdout for scripts, a prompt's logits to a
.npy file, a prompt's token ids."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .cli_options import _constraint, _device, _emit, _engine_options, _generation, _kv_note, _kv_path, _start_client


def cmd_score(a) -> int:
    import numpy as np

    from engine import api
    try:
        tokens = [int(x) for x in a.tokens.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got {a.tokens!r}") from None
    if not tokens:
        raise ValueError("--tokens is empty")
    lm = api.open_model(Path(a.model), mmproj=a.mmproj)
    images = api.load_images(lm, a.image, a.image_tokens)
    np.save(a.out, api.score(lm, tokens, images, api.load_audio(lm, a.audio)))
    return 0

def cmd_tokenize(a) -> int:
    from engine import api
    print(json.dumps(api.tokenize(Path(a.model), a.text, a.image, a.image_tokens, a.mmproj, a.audio)))
    return 0

def cmd_run(a) -> int:
    from engine import api
    constraint = _constraint(a)  # a bad schema or grammar is refused before the model loads
    lm = api.open_model(api.resolve_model(a.model), exact=a.exact, device=_device(a),
                        embed_weights=a.embed_weights, mmproj=a.mmproj, options=_engine_options(a))
    images = api.load_images(lm, a.image, a.image_tokens)  # refused in one line before the engine starts
    audio = api.load_audio(lm, a.audio)
    # a base model's text is continued (no chat turns), with its defaults where no flag is given;
    # --raw continues the text as is on any model
    base = api.model_kind(lm)[0] == "base"
    gen = _generation(a, base, kv_session=_kv_path(a), image_tokens=a.image_tokens, constraint=constraint)
    client = _start_client(lm, _engine_options(a))
    try:
        out = api.run_prompt(client, lm, a.prompt, gen, raw=a.raw, system=a.system,
                             on_text=None if a.json else _emit, images=images, audio=audio)
        out["speculative"] = client.status().get("speculative")
    finally:
        client.close()  # waits for the KV file to be written
    _kv_note(out["timings"], client)
    if a.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        t = out["timings"]
        sys.stdout.write("\n")
        restored = f", {t['restored_tokens']} restored from {Path(a.kv_session).name}" if t.get("restored_tokens") else ""
        print(f"[{t['prompt_tokens']} prompt tokens ({t['prefilled_tokens']} prefilled{restored}) at "
              f"{t['prefill_tok_s']:.1f} tok/s, {t['output_tokens']} generated at {t['decode_tok_s']:.1f} tok/s]",
              file=sys.stderr)
    return 0
