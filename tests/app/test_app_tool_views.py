"""Tools and host experts in the app: the status panel's lines for expert banks in host RAM, and a
reopened conversation's tool calls and results as collapsed blocks."""
from app.widgets.status_panel import StatusPanel


def test_host_experts_show_their_traffic_and_the_caches_hit_rate():
    p = StatusPanel()
    experts = {"layers": 30, "crossings": 90, "to_host": 3 << 20, "to_device": 2 << 20, "hit_rate": 0.4321,
               "cache_slots": 12, "lookups": 720, "copies": 40}
    p.refresh_from({"model": "26B-A4B"}, {"host_experts": experts}, 0, None)
    assert "experts 30 layers in host RAM, 3 MiB out, 2 MiB back" in p.lines
    assert "  hot   43% on the GPU, 12 slots a layer" in p.lines
    p.refresh_from({"model": "E2B"}, {"host_experts": None}, 0, None)
    assert not any(line.startswith(("experts", "  hot")) for line in p.lines)


def test_whole_layers_on_the_cpu_show_their_runtime_crossings_and_time():
    p = StatusPanel()
    layers = {"layers": 28, "runtime": "ggml", "forwards": 4, "rows": 40, "crossings": 4, "to_device": 3 << 20,
              "cpu_ms": 1234.0}
    p.refresh_from({"model": "31B"}, {"cpu_layers": layers}, 0, None)
    assert "layers  28 on the CPU (ggml), 3 MiB over" in p.lines and "  cpu   308.5 ms a forward" in p.lines
    p.refresh_from({"model": "31B"}, {"cpu_layers": None}, 0, None)
    assert not any(line.startswith("layers") for line in p.lines)


def test_a_reopened_tool_call_shows_its_calls_and_results_collapsed():
    import asyncio

    from textual.app import App
    from textual.widgets import Collapsible, Static

    from app.widgets.message_view import MessageView

    calls = {"calls": [{"id": "c1", "name": "clock", "arguments": {"zone": "utc"}}]}

    class One(App):
        def compose(self):
            yield MessageView("assistant", "Let me look.", tool=calls)
            yield MessageView("tool", '{"time": "12:34"}', tool={"call_id": "c1", "name": "clock", "status": "ok"})
            yield MessageView("tool", "the user declined this call", tool={"call_id": "c2", "name": "shell",
                                                                             "status": "denied"})

    async def run():
        async with One().run_test() as pilot:
            views = list(pilot.app.query(MessageView))
            titles = [c.title for v in views for c in v.query(Collapsible) if c.display]
            assert titles == ["call clock", "result of clock", "result of shell (denied)"]
            assert all(c.collapsed for v in views for c in v.query(".tool-call, .tool-result"))
            texts = [str(s.render()) for v in views for s in v.query(".tool-text").results(Static)]
            assert texts[0] == '{\n "zone": "utc"\n}' and texts[1] == '{"time": "12:34"}'
            assert [str(v.query_one(".role").render()) for v in views] == ["Model", "Tool", "Tool"]

    asyncio.run(run())
