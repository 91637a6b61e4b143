"""The setup subcommands of `edgegem`: doctor, pull, models, import (registered by app/cli.py)."""
from __future__ import annotations

import argparse
import sys


def _dir_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", metavar="DIR", help="edgegem's data folder (default: $EDGEGEM_DATA_DIR, "
                                                     "else the platform's user data dir)")
    p.add_argument("--models-dir", metavar="DIR", help="where models live (default: $EDGEGEM_MODELS_DIR, "
                                                       "else DATA_DIR/models)")


def add_commands(sub) -> None:
    d = sub.add_parser("doctor", help="check Python, torch, CUDA, GPU, driver, Triton, memory and folders")
    _dir_args(d)
    d.add_argument("--json", action="store_true")

    p = sub.add_parser("pull", help="download a GGUF (its assistant draft and image encoder) from the Hugging Face Hub")
    p.add_argument("spec", metavar="REPO[:QUANT]",
                   help="e.g. unsloth/gemma-4-E2B-it-GGUF:Q4_K_M (default quant Q4_K_M), or a short name: e2b, e4b, "
                        "26b-a4b, 31b (unsloth/gemma-4-<E2B|E4B|26B-A4B|31B>-it-GGUF)")
    p.add_argument("--draft", metavar="REPO[:QUANT]", help="take the assistant draft from this repo")
    p.add_argument("--no-draft", action="store_true", help="skip the assistant draft")
    p.add_argument("--no-mmproj", action="store_true",
                   help="skip the image encoder (the repo's mmproj*.gguf, fetched by default when it has one)")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    _dir_args(p)

    m = sub.add_parser("models", help="local models: size, architecture, quant and the context that fits")
    _dir_args(m)
    m.add_argument("--gpu-memory-budget", metavar="SIZE", help="plan for this budget (default: 90%% of free "
                                                               "device memory)")
    m.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="device of the plan")
    m.add_argument("--json", action="store_true")

    i = sub.add_parser("import", help="add a conversation exported as JSON (the app's F4) to the conversation list")
    i.add_argument("file", help="an edgegem.conversation JSON file (at most 8 MiB); its images are taken from "
                                "beside it (the <name>-images/ folder the export wrote)")
    i.add_argument("--data-dir", metavar="DIR", help="the app's data folder (default: $EDGEGEM_DATA_DIR, "
                                                     "else the platform's user data dir)")


def cmd_import(a) -> int:
    """Strict: a file that is too big, not JSON or not a conversation is refused in one line and
    nothing is written (app/store.py import_file)."""
    from pathlib import Path

    from .store import Store
    store = Store(Path(a.data_dir).expanduser() if a.data_dir else None)
    try:
        conv = store.import_file(a.file, report=lambda line: print(f"edgegem: {line}", file=sys.stderr))
        n = len(store.messages(conv.id))
    finally:
        store.close()
    print(f"imported “{conv.title}”: {n} messages, conversation {conv.id} in {store.path}")
    return 0


def cmd_doctor(a) -> int:
    from . import doctor, doctor_probes
    checks = doctor.evaluate(doctor_probes.gather(a.data_dir, a.models_dir))
    print(doctor.report(checks, a.json))
    return doctor.exit_code(checks)


def cmd_pull(a) -> int:
    from engine.models_dir import pull
    from engine.models_dir import models_dir
    r = pull(a.spec, models_dir(a.models_dir, a.data_dir), draft=a.draft, no_draft=a.no_draft, revision=a.revision,
             no_mmproj=a.no_mmproj)
    print(r.model)
    if r.draft:
        print(r.draft)
    if r.mmproj:  # found beside the model: no flag needed to send images
        print(r.mmproj)
    name = r.model if a.models_dir or a.data_dir else r.model.stem  # names resolve in the default folder only
    run = f"edgegem --model {name}" + (f" --spec-draft-model {r.draft}" if r.draft else "")
    print(f"run it: {run}", file=sys.stderr)
    return 0


def cmd_models(a) -> int:
    from engine.models_dir import models_dir

    from .models_list import model_rows, print_models
    print_models(model_rows(models_dir(a.models_dir, a.data_dir), a.gpu_memory_budget, a.device), a.json)
    return 0


COMMANDS = {"doctor": cmd_doctor, "pull": cmd_pull, "models": cmd_models, "import": cmd_import}
