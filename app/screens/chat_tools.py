"""The chat's tool loop (engine/tool_loop.py through app/backend.py): the worker generates, asks
for approval, runs each call and continues the same turn on the prefix cache; the UI thread shows
each reply's calls, each result as it comes (a "running" block first), the approval dialog, and
saves every reply and result the moment it is known, so Escape (or a crash) keeps what was done.

Thread rules as in chat.py: the worker only writes the Generation's live text and posts messages
(app/messages.py, in order per step); widgets and the store are the UI thread's.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from typing import Optional

from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import Static

from app.attachments import AttachError, shown_image
from app.backend import DECLINED, run_tool_loop, split_thinking
from app.messages import (GenerationDone, ToolApprovalNeeded, ToolCallFinished, ToolCallStarted, ToolStepDone,
                          ToolStepStarted)
from app.screens.chat_commands import one_line
from app.screens.tools import ApprovalScreen, ToolsScreen
from app.widgets.message_view import MessageView

def while_shown(handler):
    """A loop message's handler: the generation it is for still shown, else nothing to do. A
    message handled while the app closes (the loop still posting) may find its widgets gone:
    ignored then, raised otherwise."""
    async def run(self, msg):
        g = self.gen
        if g is None or msg.gen_id != g.id:
            return None
        try:
            return await handler(self, msg, g)
        except NoMatches:
            if self.is_attached and not (self.app._exit or self._closing):
                raise
    run.__doc__ = handler.__doc__
    return run


STOPPED_RESULT = "the user stopped the tool loop before this call ran"
STOPPED_RUNNING = "the user stopped the tool loop while this call ran; its result was not waited for"


@dataclass
class Reply:
    """The approval dialog's answer, handed from the UI thread to the waiting worker."""

    event: threading.Event = field(default_factory=threading.Event)
    answer: str = "deny"


def stored_calls(calls: list) -> list[dict]:
    """The engine's calls ({"id", "function": {"name", "arguments": JSON text}}) as the store keeps
    them ({"id", "name", "arguments": object}; arguments that are not a JSON object kept as text)."""
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function", {})
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = {"_text": args}
        out.append({"id": c.get("id") or f"call_{j}", "name": fn.get("name", "?"),
                    "arguments": args if isinstance(args, dict) else {"_value": args}})
    return out


class ChatToolsMixin:
    """Mixed into ChatScreen: `tools_on()`, the worker `_work_tools`, the loop's message handlers."""

    @property
    def app_tools(self):
        return getattr(self.app, "tools", None)  # app/tools/session.AppTools, None: no tools this run

    def tools_on(self) -> bool:
        """Tools go with a request when this run has some switched on and the model is a Gemma-4
        chat model (the template's tool declarations; a base model continues text)."""
        t = self.app_tools
        return (t is not None and not self.continuation and self.session.info.get("arch") == "gemma4"
                and bool(t.declarations()))

    def report_tool_failures(self) -> None:
        """A server that failed since the last look: one line in the conversation (not saved) and a
        notice; the chat goes on without its tools."""
        t = self.app_tools
        for st in t.new_failures() if t is not None else ():
            line = f"Tools: {st.line()}; the chat goes on without its tools (Ctrl+G lists them)."
            self.query_one("#messages", VerticalScroll).mount(Static(line, classes="notice tool-failure", markup=False))
            self.notify(st.line(), title="MCP server failed", severity="warning", timeout=8)

    def action_tools(self) -> None:
        if self.app_tools is None:
            self.notify("No tools in this run: write mcp.json in the data folder (docs/tools.md), or start "
                        "edgegem with --mcp-config FILE, --allow-dir DIR or --shell-tool.", title="Tools",
                        timeout=8)
            return
        self.app.push_screen(ToolsScreen(self.app_tools))

    def with_tools(self, g, params):
        """UI thread, before the worker starts: the request's tools and choice, the loop's step limit
        (this conversation's settings: the worker never reads the store)."""
        s = self.settings
        g.tool_steps = max(1, int(s.get("tool_steps", 8)))
        return replace(params, tools=self.app_tools.declarations(), tool_choice=s.get("tool_choice", "auto"))

    # --- the worker ----------------------------------------------------------------------------
    def _work_tools(self, g, msgs: list[dict], params) -> None:
        tools = self.app_tools
        conversation = g.conversation_id

        def on_submit(step: int, rid: int) -> None:
            if step:
                g.new_step(step)
                self.post_message(ToolStepStarted(g.id, step))
            g.request_id = rid
            if g.stop_requested:
                self.client.abort(rid)

        def on_event(ev) -> None:
            g.append(ev.text, len(ev.token_ids))
            if ev.finished:
                g.last_stats, g.error_kind = ev.stats, ev.error_kind
            if ev.finished and ev.finish_reason == "tool_calls" and ev.tool_calls:
                self.post_message(ToolStepDone(g.id, g.text, ev.tool_calls, ev.stats))

        def approve(call: dict) -> bool:
            spec = tools.box.spec_for_call(call)
            if spec is None or not spec.enabled:
                return True  # the call's result says why nothing ran (unknown, switched off)
            if not tools.policy.needs_asking(spec, conversation):
                return True
            reply = Reply()
            self.post_message(ToolApprovalNeeded(g.id, spec, stored_calls([call])[0]["arguments"], reply))
            while not reply.event.wait(0.1):
                if g.stop_requested or not self.is_attached:  # Escape, or the app closing
                    return False
            if reply.answer == "stop":
                g.stop_requested = True
                return False
            from app.tools.approval import Decision
            return tools.policy.decide(spec, Decision(reply.answer), conversation)

        def call_tool(call: dict) -> tuple[str, bool]:
            self.post_message(ToolCallStarted(g.id, call))
            done: list = []  # the call in a thread of its own: Escape does not wait for a slow tool
            threading.Thread(target=lambda: done.append(tools.box.call_parsed(call)), name="edgegem-tool-call",
                             daemon=True).start()
            while not done:
                if g.stop_requested or not self.is_attached:
                    return STOPPED_RUNNING, True  # its server finishes it (or times it out) unwatched
                threading.Event().wait(0.05)
            r = done[0]
            if r.images:  # shown as chips with the result (the model reads the text's line for each)
                g.tool_images[call.get("id")] = r.images
            return r.text, r.is_error

        try:
            out = run_tool_loop(self.client, msgs, params, call_tool, approve,
                                max_steps=g.tool_steps,
                                should_stop=lambda: g.stop_requested, on_event=on_event, on_submit=on_submit,
                                on_outcome=lambda o: self.post_message(ToolCallFinished(g.id, o)))
        except Exception as e:  # noqa: BLE001 - context overflow on a continuation...: shown, not raised
            self.post_message(GenerationDone(g.id, "", "error", one_line(e), None))
            return
        last = out.steps[-1] if out.steps else None
        stats = g.last_stats or {}
        if out.stopped in ("stopped", "step_limit"):
            self.post_message(GenerationDone(g.id, "", "tool_calls", None, stats, tool_end=out.stopped))
        elif out.stopped == "error":
            self.post_message(GenerationDone(g.id, g.text, "error", out.error, stats, g.error_kind))
        else:
            self.post_message(GenerationDone(g.id, last.text if last else "", last.finish_reason if last else "stop",
                                             None, stats))

    # --- the UI thread -------------------------------------------------------------------------
    def on_unmount(self) -> None:
        """Quitting mid-answer: the loop stops (no approval waits, no call waited for) and its
        messages still queued find no generation to show."""
        g, self.gen = self.gen, None
        if g is not None:
            g.stop_requested = True
            if g.request_id is not None:
                self.client.abort(g.request_id)

    @while_shown
    async def on_tool_step_done(self, msg: ToolStepDone, g) -> None:
        thought, answer = split_thinking(msg.text)
        calls = stored_calls(msg.calls)
        m = self._saved(lambda: self.store.add_message(g.conversation_id, "assistant", answer,
                                                       thinking=thought or "", stats={**msg.stats,
                                                       "finish_reason": "tool_calls"}, tool={"calls": calls}),
                        "the reply")
        if m is not None:
            self.messages.append(m)
        g.pending_calls = {c["id"]: c for c in calls}
        await g.view.finish(thought, answer, "done", m.id if m else None)
        await g.view.show_calls(calls)
        g.view_done = True
        self.last_stats = msg.stats
        self.refresh_status()

    @while_shown
    async def on_tool_call_started(self, msg: ToolCallStarted, g) -> None:
        call = stored_calls([msg.call])[0]
        view = MessageView("tool", "", status="running", tool={"call_id": call["id"], "name": call["name"],
                                                             "status": "running"})
        g.tool_views[call["id"]] = view
        await self.query_one("#messages", VerticalScroll).mount(view)
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    @while_shown
    async def on_tool_call_finished(self, msg: ToolCallFinished, g) -> None:
        await self._keep_result(g, msg.outcome.call, msg.outcome.result,
                                "denied" if msg.outcome.denied else "error" if msg.outcome.error else "ok")

    async def _keep_result(self, g, call: dict, text: str, status: str) -> None:
        c = stored_calls([call])[0]
        g.pending_calls.pop(c["id"], None)
        images = self._kept_images(c["name"], g.tool_images.pop(c["id"], ()))
        m = self._saved(lambda: self.store.add_message(g.conversation_id, "tool", text, images=images, tool={
            "call_id": c["id"], "name": c["name"], "status": status}), "the tool result")
        if m is not None:
            self.messages.append(m)
        view = g.tool_views.pop(c["id"], None)
        if view is None:  # denied: it never ran
            await self.query_one("#messages", VerticalScroll).mount(MessageView(
                "tool", text, message_id=m.id if m else None, images=images,
                tool={"call_id": c["id"], "name": c["name"], "status": status}))
        else:
            await view.set_result(text, status, m.id if m else None, images)
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    def _kept_images(self, tool: str, images) -> list[dict]:
        """A result's images, kept in the data folder like attachments (records for the store and
        the chips); one that is not a readable image is left out (its line in the text says so)."""
        out = []
        for j, (data, mime) in enumerate(images):
            name = f"{tool}-{j + 1}.{mime.split('/')[-1] or 'img'}"
            try:
                out.append(self.store.keep_image(data, name, 0, shown_image(data)))
            except (AttachError, OSError) as e:
                self.notify(f"{name}: {one_line(e)}", title="Tool image not shown", severity="warning")
        return out

    @while_shown
    async def on_tool_step_started(self, msg: ToolStepStarted, g) -> None:
        view = MessageView("assistant", status="streaming")
        await self.query_one("#messages", VerticalScroll).mount(view)
        view.start_stream()
        g.view, g.view_step, g.view_done, g.shown = view, msg.step, False, ""

    async def finish_tool_loop(self, g, msg: GenerationDone) -> None:
        """The loop stopped after a reply with calls: the calls that did not run get a result saying
        so (the conversation stays well-formed for the next turn), nothing else is written."""
        for c in list(g.pending_calls.values()):
            await self._keep_result(g, {"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}},
                                    STOPPED_RESULT if msg.tool_end == "stopped" else DECLINED, "denied")
        if msg.tool_end == "step_limit":
            self.notify(f"Stopped after {g.tool_steps} replies with tool calls "
                        "(Settings: tool steps). Send a message to go on.", title="Tool loop", timeout=8)

    def on_tool_approval_needed(self, msg: ToolApprovalNeeded) -> None:
        g = self.gen
        if g is None or msg.gen_id != g.id:
            msg.reply.event.set()
            return

        def answered(answer: Optional[str]) -> None:
            msg.reply.answer = answer or "deny"
            msg.reply.event.set()
        self.app.push_screen(ApprovalScreen(msg.spec, msg.call), answered)
