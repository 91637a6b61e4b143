"""`edgegem pull` against a fake Hugging Face Hub, offline.

The fake hub is an HTTP handler behind huggingface_hub's own client (`set_client_factory` with a
mock transport), so the real `HfApi.model_info` and `http_get` code runs: the JSON listing, the
302 from /resolve/ to a CDN host, Range requests on resume. Sockets are blocked for every test.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import re
import socket
from pathlib import Path

import huggingface_hub as hf
import pytest
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import _http as hf_http
from tiny_models import TinySpec, write_tiny_assistant, write_tiny_gemma4

from app.cli import main
from engine.models_dir import hub
from engine.models_dir.hub import RemoteFile, RepoSpec, choose_draft, choose_mmproj, choose_model
from engine.models_dir import find_model
from kernels.env import reload

# huggingface_hub 2.x ships its HTTP client as httpx2, 1.x used httpx
httpx = importlib.import_module("httpx2" if importlib.util.find_spec("httpx2") else "httpx")

REPO = "unsloth/gemma-4-E2B-it-GGUF"
SHA = "5d2c5f0e1f0a3b4c5d6e7f8091a2b3c4d5e6f708"
SPEC = TinySpec(d_model=64, hd_sliding=32, hd_full=64, ffn=128, ple_width=8)
MODEL, DRAFT = "gemma-4-E2B-it-Q4_K_M.gguf", "gemma-4-E2B-it-assistant-Q4_K_M.gguf"
MMPROJ = "mmproj-F16.gguf"


def write_clip_gguf(path: Path) -> Path:
    """A minimal llama.cpp mmproj header (architecture clip, one f16 tensor): what pull checks."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch="clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class FakeHub:
    """Serves the files of a local folder as the repo REPO at commit SHA."""

    def __init__(self, remote: Path, repo: str = REPO):
        self.remote, self.repo = remote, repo
        self.requests: list[tuple[str, str, str | None]] = []
        self.listed_size: dict[str, int] = {}  # override what the listing says
        self.listed_sha: dict[str, str] = {}
        self.extra_bytes: dict[str, bytes] = {}  # appended to what the CDN sends
        self.cut_after: dict[str, int] = {}  # the next download of this file dies after N bytes

    def _listing(self) -> dict:
        siblings = []
        for p in sorted(self.remote.rglob("*")):
            if not p.is_file():
                continue
            name = p.relative_to(self.remote).as_posix()
            size = self.listed_size.get(name, p.stat().st_size)
            sib = {"rfilename": name, "size": size, "blobId": "0" * 40}
            if name.endswith(".gguf"):
                sha = self.listed_sha.get(name, hashlib.sha256(p.read_bytes()).hexdigest())
                sib["lfs"] = {"size": size, "sha256": sha, "pointerSize": 134}
            siblings.append(sib)
        return {"id": self.repo, "modelId": self.repo, "sha": SHA, "private": False, "siblings": siblings}

    def handler(self, request):
        url = request.url
        self.requests.append((request.method, str(url), request.headers.get("range")))
        if url.path in (f"/api/models/{self.repo}", f"/api/models/{self.repo}/revision/main"):
            return httpx.Response(200, json=self._listing())
        if url.path.startswith("/api/models/"):
            return httpx.Response(404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "Repository not found"})
        m = re.fullmatch(rf"/{self.repo}/resolve/{SHA}/(.+)", url.path)
        if m:  # the hub redirects LFS files to its CDN
            return httpx.Response(302, headers={"Location": f"https://cdn-lfs.example/{SHA}/{m.group(1)}"})
        m = re.fullmatch(rf"/{SHA}/(.+)", url.path)
        if url.host == "cdn-lfs.example" and m:
            return self._serve(m.group(1), request.headers.get("range"))
        return httpx.Response(404)

    def _serve(self, name: str, rng: str | None):
        data = (self.remote / name).read_bytes() + self.extra_bytes.get(name, b"")
        start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1)) if rng else 0
        body = data[start:]
        headers = {"Content-Length": str(len(body)), "Accept-Ranges": "bytes"}
        if rng:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.cut_after.pop(name, None)
        if cut is None:
            return httpx.Response(206 if rng else 200, headers=headers, content=body)
        return httpx.Response(206 if rng else 200, headers=headers, stream=_DyingStream(body[:cut]))


class _DyingStream(httpx.SyncByteStream):
    """Sends some bytes, then the connection resets (a ReadError: http_get does not retry it)."""

    def __init__(self, head: bytes):
        self.head = head

    def __iter__(self):
        for i in range(0, len(self.head), 65536):
            yield self.head[i:i + 65536]
        raise httpx.ReadError("connection reset by peer")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any real connection attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    remote = tmp_path / "remote"
    remote.mkdir()
    write_tiny_gemma4(remote / MODEL, SPEC, seed=1)
    write_tiny_gemma4(remote / "gemma-4-E2B-it-Q8_0.gguf", SPEC, seed=2)
    write_tiny_assistant(remote / DRAFT, SPEC, d_model=32, ffn=64)
    write_clip_gguf(remote / MMPROJ)
    write_clip_gguf(remote / "mmproj-F32.gguf")
    (remote / "README.md").write_text("# tiny\n")
    fake = FakeHub(remote)
    hf_http.set_client_factory(lambda: httpx.Client(
        transport=httpx.MockTransport(fake.handler), follow_redirects=True,
        event_hooks={"request": [hf_http.hf_request_event_hook]}))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 65536)  # so a cut leaves whole chunks on disk
    monkeypatch.setenv("HF_TOKEN", "hf_fake")  # no token file lookups
    monkeypatch.setenv("EDGEGEM_MODELS_DIR", str(tmp_path / "models"))
    reload()
    yield fake
    hf_http.set_client_factory(hf_http.default_client_factory)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# -- choosing files ------------------------------------------------------------------------------

def test_parse_spec():
    assert RepoSpec.parse(f"{REPO}:q4_k_m") == RepoSpec(REPO, "q4_k_m")
    assert RepoSpec.parse(REPO) == RepoSpec(REPO, None)
    assert RepoSpec.parse(f"hf.co/{REPO}:Q8_0") == RepoSpec(REPO, "Q8_0")
    assert RepoSpec.parse(f"https://huggingface.co/{REPO}/") == RepoSpec(REPO, None)
    for bad in ("gemma", "a/b/c", "a/b:Q4 K", ""):
        with pytest.raises(ValueError, match="expected REPO"):
            RepoSpec.parse(bad)


def _files(*names):
    return [RemoteFile(n, 10) for n in names]


def test_choose_model_by_quant():
    files = _files("gemma-4-E2B-it-Q4_K_M.gguf", "gemma-4-E2B-it-UD-Q4_K_M.gguf", "gemma-4-E2B-it-Q4_K_S.gguf",
                   "gemma-4-E2B-it-Q8_0.gguf", "gemma-4-E2B-it-assistant-Q8_0.gguf", "mmproj-F16.gguf", "README.md")
    assert choose_model("r", files, "q4_k_m").name == "gemma-4-E2B-it-Q4_K_M.gguf"  # not the UD- one
    assert choose_model("r", files, "UD-Q4_K_M").name == "gemma-4-E2B-it-UD-Q4_K_M.gguf"
    assert choose_model("r", files, None).name == "gemma-4-E2B-it-Q4_K_M.gguf"
    assert choose_model("r", files, "Q8_0").name == "gemma-4-E2B-it-Q8_0.gguf"  # the assistant is no model
    with pytest.raises(ValueError, match=r"no Q4_K GGUF \(it has: Q4_K_M, Q4_K_S, Q8_0, UD-Q4_K_M\)"):
        choose_model("r", files, "Q4_K")  # a prefix of a quant is not that quant
    with pytest.raises(ValueError, match=r"has no Q4_K_M GGUF: name one, e.g. r:Q8_0 \(it has: BF16, Q8_0\)"):
        choose_model("r", _files("m-Q8_0.gguf", "m-BF16.gguf"), None)
    assert choose_model("r", _files("only.gguf"), None).name == "only.gguf"
    with pytest.raises(ValueError, match="split into shards"):
        choose_model("r", _files("BF16/m-BF16-00001-of-00002.gguf", "BF16/m-BF16-00002-of-00002.gguf"), "BF16")
    with pytest.raises(ValueError, match="has no GGUF model file"):
        choose_model("r", _files("README.md", "mmproj-F16.gguf"), None)


def test_choose_mmproj():
    assert choose_mmproj(_files("m-Q4_K_M.gguf", "mmproj-F32.gguf", "mmproj-BF16.gguf", "mmproj-F16.gguf")).name \
        == "mmproj-F16.gguf"  # 16 bits: the encoder is dequantized at load, F32 only doubles the download
    assert choose_mmproj(_files("mmproj-model-f32.gguf")).name == "mmproj-model-f32.gguf"
    assert choose_mmproj(_files("m-Q4_K_M.gguf", "mmproj.txt")) is None


def test_choose_draft():
    files = _files("m-Q4_K_M.gguf", "m-assistant-Q4_K_M.gguf", "m-assistant-Q8_0.gguf", "m-assistant-F16.gguf")
    assert choose_draft("r", files, "Q4_K_M").name == "m-assistant-Q4_K_M.gguf"
    assert choose_draft("r", files, "Q5_K_M").name == "m-assistant-Q8_0.gguf"  # the preferred draft form
    assert choose_draft("r", _files("m-Q4_K_M.gguf"), "Q4_K_M") is None
    assert choose_draft("r", _files("m-mtp-BF16.gguf"), "Q4_K_M").name == "m-mtp-BF16.gguf"
    assert choose_draft("r", _files("d-Q8_0.gguf"), None, any_gguf=True).name == "d-Q8_0.gguf"  # --draft repo
    with pytest.raises(ValueError, match="several assistant drafts"):
        choose_draft("r", _files("a-assistant-Q5_K_M.gguf", "a-assistant-Q6_K.gguf"), None)


# -- downloads -----------------------------------------------------------------------------------

def test_pull_downloads_verifies_and_prints_paths(fake_hub, tmp_path, capsys):
    assert main(["pull", f"{REPO}:q4_k_m"]) == 0
    out = capsys.readouterr()
    model = tmp_path / "models" / REPO / MODEL
    draft = tmp_path / "models" / REPO / DRAFT
    mmproj = tmp_path / "models" / REPO / MMPROJ  # beside the model, where load_model looks
    assert out.out.splitlines() == [str(model), str(draft), str(mmproj)]
    assert _sha(model) == _sha(fake_hub.remote / MODEL) and _sha(draft) == _sha(fake_hub.remote / DRAFT)
    assert _sha(mmproj) == _sha(fake_hub.remote / MMPROJ)
    assert "GGUF gemma4," in out.err and "GGUF gemma4-assistant," in out.err and "GGUF clip," in out.err
    assert f"edgegem --model {model.stem} --spec-draft-model {draft}" in out.err
    assert not list((tmp_path / "models").rglob("*.part*"))  # no partial or lock files left
    gets = [u for m, u, _ in fake_hub.requests if "cdn-lfs" in u]
    assert len(gets) == 3 and not any("F32" in u or "Q8_0" in u for u in gets)
    # the encoder is no model of its own: names still find the model
    for name in (REPO, "E2B-it-GGUF", "e2b"):
        assert find_model(name, tmp_path / "models") == model
    assert find_model("mmproj", tmp_path / "models") == mmproj

    fake_hub.requests.clear()  # a second pull finds both files in place: listing only, no download
    assert main(["pull", REPO]) == 0
    assert "already here" in capsys.readouterr().err
    assert all("/api/models/" in u for _, u, _ in fake_hub.requests)


def test_no_mmproj_skips_the_image_encoder(fake_hub, tmp_path, capsys):
    assert main(["pull", REPO, "--no-mmproj"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [str(tmp_path / "models" / REPO / MODEL), str(tmp_path / "models" / REPO / DRAFT)]
    assert not [u for _, u, _ in fake_hub.requests if "mmproj" in u and "cdn-lfs" in u]
    assert not list((tmp_path / "models").rglob("mmproj*"))
    (fake_hub.remote / MMPROJ).unlink()
    (fake_hub.remote / "mmproj-F32.gguf").unlink()
    assert main(["pull", REPO]) == 0  # a repo without one: the pull is as before
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_models_lists_the_encoder_as_such(fake_hub, tmp_path, capsys):
    assert main(["pull", REPO, "--no-draft"]) == 0
    capsys.readouterr()
    assert main(["models", "--device", "cpu"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "mmproj" in ln)
    assert "image encoder (mmproj) of the model beside it" in row


def test_no_draft_and_explicit_draft_repo(fake_hub, tmp_path, capsys):
    assert main(["pull", f"{REPO}:Q8_0", "--no-draft", "--no-mmproj", "--models-dir", str(tmp_path / "m2")]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "m2" / REPO / "gemma-4-E2B-it-Q8_0.gguf")]
    assert main(["pull", REPO, "--draft", "someone/other-GGUF"]) == 2
    assert "no model repo someone/other-GGUF" in capsys.readouterr().err


def test_interrupted_download_resumes(fake_hub, tmp_path, capsys):
    size = (fake_hub.remote / MODEL).stat().st_size
    fake_hub.cut_after[MODEL] = 5 * 65536
    assert main(["pull", f"{REPO}:Q4_K_M", "--no-draft", "--no-mmproj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"edgegem: error: download of {MODEL} stopped at {5 * 65536} of {size} bytes "
                   "(connection reset by peer); run the same pull again to resume")
    part = tmp_path / "models" / REPO / (MODEL + ".part")
    assert part.stat().st_size == 5 * 65536 and not (tmp_path / "models" / REPO / MODEL).exists()

    fake_hub.requests.clear()
    assert main(["pull", f"{REPO}:Q4_K_M", "--no-draft", "--no-mmproj"]) == 0
    assert "resuming at" in capsys.readouterr().err
    ranges = [r for _, u, r in fake_hub.requests if "cdn-lfs" in u]
    assert ranges == [f"bytes={5 * 65536}-"]  # only the missing tail travelled
    assert _sha(tmp_path / "models" / REPO / MODEL) == _sha(fake_hub.remote / MODEL)
    assert not part.exists()


def test_wrong_size_or_hash_is_refused(fake_hub, tmp_path, capsys):
    fake_hub.extra_bytes[MODEL] = b"junk"  # the CDN sends more than the listing says
    assert main(["pull", REPO, "--no-draft", "--no-mmproj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    size = (fake_hub.remote / MODEL).stat().st_size
    assert err[-1] == (f"edgegem: error: {MODEL}: the server sent {size + 4} bytes but the hub lists {size}; "
                       "the bad copy was removed")
    assert not list((tmp_path / "models").rglob("*.gguf*"))

    fake_hub.extra_bytes.clear()
    fake_hub.listed_sha[MODEL] = "0" * 64
    assert main(["pull", REPO, "--no-draft", "--no-mmproj"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"edgegem: error: {MODEL}: sha256 [0-9a-f]{{12}}\.\.\. differs from the hub's "
                        r"000000000000\.\.\.; the bad copy was removed, run the pull again", err[-1])
    assert not list((tmp_path / "models").rglob("*.gguf*"))


def test_part_longer_than_the_file_restarts(fake_hub, tmp_path, capsys):
    d = tmp_path / "models" / REPO
    d.mkdir(parents=True)
    (d / (MODEL + ".part")).write_bytes(b"x" * ((fake_hub.remote / MODEL).stat().st_size + 1))
    assert main(["pull", REPO, "--no-draft", "--no-mmproj"]) == 0
    assert [r for _, u, r in fake_hub.requests if "cdn-lfs" in u] == [None]
    assert _sha(d / MODEL) == _sha(fake_hub.remote / MODEL)


def test_not_a_gguf_is_refused(fake_hub, tmp_path, capsys):
    (fake_hub.remote / "broken-Q4_K_M.gguf").write_bytes(b"not a gguf at all")
    assert main(["pull", f"{REPO}:Q4_K_M", "--no-draft", "--no-mmproj"]) == 2  # two Q4_K_M files now
    assert "2 files match the quant Q4_K_M" in capsys.readouterr().err
    (fake_hub.remote / MODEL).unlink()
    assert main(["pull", f"{REPO}:Q4_K_M", "--no-draft", "--no-mmproj"]) == 2
    assert capsys.readouterr().err.strip().endswith("broken-Q4_K_M.gguf: not a GGUF file (bad magic)")


def test_huggingface_cache_copy_is_reused(fake_hub, tmp_path, capsys):
    """A file the huggingface_hub cache holds at the listed commit is linked, not downloaded. The
    cache is laid out by hand here; the real `hf_hub_download` finds it offline, so the layout is
    the library's own."""
    cache = Path(hf_constants.HF_HUB_CACHE) / f"models--{REPO.replace('/', '--')}"
    sha256 = _sha(fake_hub.remote / MODEL)
    (cache / "blobs").mkdir(parents=True)
    (cache / "blobs" / sha256).write_bytes((fake_hub.remote / MODEL).read_bytes())
    (cache / "snapshots" / SHA).mkdir(parents=True)
    (cache / "snapshots" / SHA / MODEL).symlink_to(Path("..") / ".." / "blobs" / sha256)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(SHA)
    found = hf.hf_hub_download(REPO, MODEL, local_files_only=True, cache_dir=hf_constants.HF_HUB_CACHE)
    assert Path(found).resolve() == (cache / "blobs" / sha256).resolve()

    assert main(["pull", REPO, "--no-draft", "--no-mmproj"]) == 0
    assert "taking the copy in the huggingface_hub cache" in capsys.readouterr().err
    assert not [u for _, u, _ in fake_hub.requests if "cdn-lfs" in u]
    assert _sha(tmp_path / "models" / REPO / MODEL) == sha256


def test_offline_uses_what_was_pulled(fake_hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert main(["pull", REPO]) == 2
    assert capsys.readouterr().err.strip() == f"edgegem: error: cannot list {REPO}: offline mode (HF_HUB_OFFLINE)"
    assert not fake_hub.requests  # offline mode stops requests before the transport

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    assert main(["pull", REPO]) == 0
    capsys.readouterr()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert main(["pull", REPO]) == 0
    out = capsys.readouterr()
    assert "cannot reach the hub; using the files already in" in out.err
    assert out.out.splitlines() == [str(tmp_path / "models" / REPO / f) for f in (MODEL, DRAFT, MMPROJ)]


def test_listing_sizes_come_from_lfs(fake_hub):
    sha, files = hub.list_remote(REPO)
    by_name = {f.name: f for f in files}
    assert sha == SHA
    assert by_name[MODEL].size == (fake_hub.remote / MODEL).stat().st_size
    assert by_name[MODEL].sha256 == _sha(fake_hub.remote / MODEL)
    assert by_name["README.md"].sha256 is None
    json.dumps([f.__dict__ for f in files])  # plain data


# -- the 26B-A4B and 31B repos ---------------------------------------------------------------------
BIG_REPOS = {"26b-a4b": "unsloth/gemma-4-26B-A4B-it-GGUF", "31b": "unsloth/gemma-4-31B-it-GGUF"}


@pytest.mark.parametrize("text,repo,quant", [
    ("unsloth/gemma-4-26B-A4B-it-GGUF:Q4_K_M", BIG_REPOS["26b-a4b"], "Q4_K_M"),
    ("unsloth/gemma-4-31B-it-GGUF:Q4_K_M", BIG_REPOS["31b"], "Q4_K_M"),
    ("hf.co/unsloth/gemma-4-31B-it-GGUF", BIG_REPOS["31b"], None),
    ("26b-a4b", BIG_REPOS["26b-a4b"], None), ("26B-A4B:Q8_0", BIG_REPOS["26b-a4b"], "Q8_0"),
    ("31b:q4_k_m", BIG_REPOS["31b"], "q4_k_m"), ("e2b", REPO, None),
])
def test_big_model_names_and_short_names_resolve(text, repo, quant):
    assert RepoSpec.parse(text) == RepoSpec(repo, quant)


@pytest.mark.parametrize("size", ["26B-A4B", "31B"])
def test_big_repo_listing_picks_the_q4_k_m_file_and_f16_encoder(size):
    """A listing shaped like unsloth's (dynamic UD- quants beside the plain ones, MXFP4_MOE, BF16
    in shards, three encoders): Q4_K_M picks the plain single file, no draft, the F16 encoder."""
    stem = f"gemma-4-{size}-it"
    files = [RemoteFile(n, 1) for n in (
        f"{stem}-Q4_K_M.gguf", f"{stem}-UD-Q4_K_M.gguf", f"{stem}-UD-Q4_K_XL.gguf", f"{stem}-Q8_0.gguf",
        f"{stem}-MXFP4_MOE.gguf", f"BF16/{stem}-BF16-00001-of-00002.gguf", f"BF16/{stem}-BF16-00002-of-00002.gguf",
        "mmproj-BF16.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf", "README.md")]
    repo = f"unsloth/{stem}-GGUF"
    assert choose_model(repo, files, "Q4_K_M").name == f"{stem}-Q4_K_M.gguf"
    assert choose_model(repo, files, None).name == f"{stem}-Q4_K_M.gguf"  # the default quant
    assert choose_model(repo, files, "UD-Q4_K_XL").name == f"{stem}-UD-Q4_K_XL.gguf"
    assert choose_draft(repo, files, "Q4_K_M") is None and choose_mmproj(files).name == "mmproj-F16.gguf"
    with pytest.raises(ValueError, match="split into shards"):
        choose_model(repo, files, "BF16")


def test_pull_by_short_name_fetches_the_26b_and_names_find_it(fake_hub, tmp_path, capsys):
    """`edgegem pull 26b-a4b` against a hub serving the 26B-A4B repo (its Q4_K_M file: the synthetic
    MoE layout scaled down, models/synthetic.py), then the names a user types find the file."""
    from models.synthetic_gguf import write_synthetic_gguf

    for p in fake_hub.remote.iterdir():
        p.unlink()
    stem = "gemma-4-26B-A4B-it"
    write_synthetic_gguf("tiny-moe", fake_hub.remote / f"{stem}-Q4_K_M.gguf", seed=1)
    write_synthetic_gguf("tiny-moe", fake_hub.remote / f"{stem}-UD-Q4_K_XL.gguf", seed=2)
    write_clip_gguf(fake_hub.remote / MMPROJ)
    fake_hub.repo = BIG_REPOS["26b-a4b"]
    assert main(["pull", "26b-a4b"]) == 0
    out = capsys.readouterr()
    model = tmp_path / "models" / BIG_REPOS["26b-a4b"] / f"{stem}-Q4_K_M.gguf"
    assert out.out.splitlines() == [str(model), str(model.parent / MMPROJ)]
    assert "GGUF gemma4," in out.err
    for name in (BIG_REPOS["26b-a4b"], f"{BIG_REPOS['26b-a4b']}:Q4_K_M", "26B-A4B-it-Q4_K_M", "26b-a4b"):
        assert find_model(name, tmp_path / "models") == model
