"""Tools in `edgegem chat`: the MCP servers and built-ins (app/tools/) offered to the model, each
call asked at the prompt (y once / c this conversation / a always / n no; `--yes-tools` skips
asking, never for the shell tool), run, and its result given back through the engine's tool loop
(engine/tool_loop.py: each step prefills only the results). Only text is printed: a call's name and
arguments, the result's first line."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Callable, Optional


def tools_wanted(a, data_dir=None) -> bool:
    """Whether this chat offers tools: a config, a folder for the file tools or the shell tool given,
    or a `mcp.json` in the data folder."""
    from .tools.config import default_config_path

    return bool(a.mcp_config or a.allow_dir or a.shell_tool) or default_config_path(data_dir).exists()


def app_tools(a, data_dir):
    """The chat app's tools (app/tools/session.AppTools, started by the app), or None when none are
    wanted. A config file that cannot be read is refused here, in one line, before the app opens."""
    if a.max_tool_steps is not None and a.max_tool_steps < 1:
        raise ValueError(f"--max-tool-steps must be at least 1, not {a.max_tool_steps}")
    if not tools_wanted(a, data_dir):
        return None
    from .tools import load_config
    from .tools.session import AppTools, ToolOptions

    return AppTools(ToolOptions(load_config(a.mcp_config, data_dir), a.allow_dir, shell=a.shell_tool,
                                yes_tools=a.yes_tools), data_dir)


def open_toolbox(a):
    """The tools of this chat, servers starting in the background (None when none are wanted)."""
    if not tools_wanted(a):
        return None, None
    from .tools import ToolBox, load_config
    from .tools.approval import ApprovalPolicy

    box = ToolBox.create(load_config(a.mcp_config, None), a.allow_dir, shell=a.shell_tool)
    box.start()
    return box, ApprovalPolicy.in_data_dir(None, yes_tools=a.yes_tools)


def asker(box, policy, conversation, read: Callable[[str], str] = input) -> Callable[[dict], bool]:
    """run_tool_loop's `approve`: unknown tools are refused; known ones asked unless the policy
    already allows them."""
    from .tools.approval import Decision

    def approve(call: dict) -> bool:
        spec = box.spec_for_call(call)
        if spec is None:
            return False
        if not policy.needs_asking(spec, conversation):
            return True
        args = json.dumps(call["function"].get("arguments"), ensure_ascii=False)
        while True:
            try:
                answer = read(f"\ntool> {spec.name} {args}\n      allow? [y]es once, [c] this conversation, "
                              "[a]lways, [n]o: ")
            except EOFError:
                answer = "n"
            decision = Decision.from_answer(answer)
            if decision is not None:
                return policy.decide(spec, decision, conversation)

    return approve


def reply_with_tools(client, history: list, gen, box, approve, emit: Callable[[str], None], max_steps: int,
                     tool_choice: Optional[str] = None):
    """One answer through the tool loop -> (the messages to add to the history, the answer text,
    the loop's result). The history gets each reply with its calls and each result as a tool message."""
    from engine.tool_loop import run_tool_loop

    params = replace(gen, tools=box.declarations() or None, tool_choice=tool_choice if box.declarations() else None)

    def on_event(ev):
        emit(ev.text)

    def call_tool(call):
        text, failed = box.call_for_loop(call)
        first = text.strip().splitlines()[0] if text.strip() else ""
        emit(f"\n[{call['function']['name']} {'failed' if failed else 'result'}: {first[:160]}]\n")
        return text, failed

    out = run_tool_loop(client, history, params, call_tool, approve, max_steps=max_steps, on_event=on_event)
    added = []
    for step in out.steps:
        if step.outcomes:
            added.append({"role": "assistant", "content": step.text,
                          "tool_calls": [o.call for o in step.outcomes]})
            added += [{"role": "tool", "tool_call_id": o.call.get("id"), "name": o.call["function"]["name"],
                       "content": o.result} for o in step.outcomes]
        else:
            added.append({"role": "assistant", "content": step.text})
    if out.stopped == "step_limit":
        print(f"\nedgegem: stopped after {max_steps} tool steps (--max-tool-steps)", file=sys.stderr)
    return added, out.answer, out
