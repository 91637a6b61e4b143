"""The status panel's lines for expert banks in host RAM beside a GPU (the engine's `host_experts`)."""
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
