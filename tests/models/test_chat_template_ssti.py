"""Chat templates come from GGUF files, so they are hostile input: template-injection payloads never
run code, and resource bombs never make one render take unbounded time or memory.

Every code-execution payload tries to touch a marker file (os.system, popen, subprocess, open, eval,
exec, __import__) through a different path to Python internals: function globals (cycler, joiner,
namespace, lipsum, range, raise_exception, strftime_now), class walks (__class__, __mro__, __base__,
__subclasses__, mro()), __builtins__ / __import__ as names, `self`, Flask-style `config`/`request`,
`|attr` and subscripts with names built at run time, str.format / format_map / `%` formatting,
generator frames, filters' `attribute=` arguments, mutation of the context, and loading other
templates. Each must fail with the one-line `ChatTemplateError`, leave no marker, and raise no
process/file/network audit event (a `sys.addaudithook` tripwire armed while the template compiles
and renders). Resource bombs (huge and nested loops, exponential recursion, format widths, string and
integer blow-ups, shared-sub-list printing) run in a child process under a 2 GB address-space limit
and must each be refused, not run into MemoryError.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from models.chat import ChatFormat, ChatTemplateError, Message
from models.gguf import GGUFFile

REPO = Path(__file__).resolve().parents[2]
UNSAFE = "unsafe chat template"

# --- code execution ------------------------------------------------------------------------------
# (payload, start of the expected error); MARKER is replaced by a path that must never appear.
EXEC = [
    # globals of the functions the environment exposes
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ joiner.__init__.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ namespace.__init__.__globals__.__builtins__['__import__']('os').system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ lipsum.__globals__.__builtins__.open('MARKER', 'w').write('x') }}",
    "{{ range.__globals__['__builtins__']['exec'](\"open('MARKER', 'w')\") }}",
    "{{ raise_exception.__globals__['json'].__builtins__['__import__']('os').system('touch MARKER') }}",
    "{{ strftime_now.__globals__['datetime'].__builtins__['eval'](\"__import__('os').system('touch MARKER')\") }}",
    "{{ cycler.__init__.__globals__.__builtins__.__import__('subprocess').run(['touch', 'MARKER']) }}",
    # class hierarchy walks
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__base__.__subclasses__()[0] }}",
    "{{ [].__class__.__bases__[0].__subclasses__() }}",
    ("{% for c in ''.__class__.__mro__[-1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
     "{{ c('touch MARKER', shell=True) }}{% endif %}{% endfor %}"),
    "{{ messages.__class__.__mro__ }}",
    "{{ messages[0].__class__.__base__.__subclasses__() }}",
    "{{ dict.mro()[-1].__subclasses__() }}",
    "{{ dict.mro() }}",
    "{{ (dict|attr('mr' ~ 'o'))() }}",
    # __builtins__ / __import__ as plain names
    "{{ __builtins__.open('MARKER', 'w').write('x') }}",
    "{{ __import__('os').system('touch MARKER') }}",
    "{% set b = cycler.__init__.__globals__.__builtins__ %}{{ b.eval(\"__import__('os').system('touch MARKER')\") }}",
    # self, and the Flask-style config / request / url_for
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ self.__dict__ }}",
    "{{ self|attr('_Template' ~ 'Reference__context') }}",
    "{{ config.__class__.__init__.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ config|attr('__cla' ~ 'ss__') }}",
    "{{ request.application.__globals__.__builtins__.__import__('os').popen('touch MARKER').read() }}",
    "{{ url_for.__globals__.os.system('touch MARKER') }}",
    "{{ get_flashed_messages.__globals__['os'].system('touch MARKER') }}",
    # |attr, with names written out and built at run time
    "{{ cycler|attr('__init__')|attr('__globals__') }}",
    "{{ (cycler|attr('__in' ~ 'it__')|attr('__glo' ~ 'bals__'))['os'].system('touch MARKER') }}",
    "{{ cycler|attr('\\x5f\\x5finit\\x5f\\x5f') }}",
    "{{ (cycler|attr(['_', '_init__']|join)|attr(['__glo', 'bals__']|join))['os'].system('touch MARKER') }}",
    "{{ cycler|attr('%c%cinit%c%c'|format(95, 95, 95, 95)) }}",
    "{{ cycler|attr('%c%cinit%c%c' % (95, 95, 95, 95)) }}",
    "{{ cycler|attr('_' * 2 ~ 'init' ~ '_' * 2) }}",
    "{{ cycler|attr('__INIT__'|lower) }}",
    "{{ cycler|attr('__tini__'|reverse) }}",
    "{{ lipsum|attr(('_' * 2) ~ 'globals' ~ ('_' * 2)) }}",
    "{{ raise_exception|attr('__co' ~ 'de__') }}",
    "{{ ''.join|attr('__se' ~ 'lf__') }}",
    "{{ cycler(1).next|attr('__se' ~ 'lf__') }}",
    "{{ joiner()|attr('__ca' ~ 'll__') }}",
    "{{ (range|attr('__glob' ~ 'als__'))['__builtins__'] }}",
    # subscripts
    "{% set a = '__class__' %}{{ ''[a] }}",
    "{{ lipsum[('_' * 2) ~ 'globals' ~ ('_' * 2)]['os'].system('touch MARKER') }}",
    "{{ cycler['__init__'] }}",
    "{{ messages[0]['__cla' ~ 'ss__'] }}",
    "{{ ''['__class__']['__base__'] }}",
    # format strings: str.format, format_map, `%` and the format filter
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '{0.__init__.__globals__[os]}'.format(cycler) }}",
    "{{ '{0[__class__]}'.format(messages[0]) }}",
    "{{ '{a.__class__}'.format_map({'a': messages}) }}",
    "{{ ('{0.__cl' ~ 'ass__}').format(cycler) }}",
    "{{ ('{0.__class__}'|attr('format'))(messages) }}",                          # CVE-2025-27516
    "{% set f = '{0.__init__.__globals__}'.format %}{{ f(cycler) }}",              # CVE-2024-56326
    "{% for f in ['{0.__class__}']|map(attribute='format') %}{{ f(messages) }}{% endfor %}",
    "{{ '{0.gi_frame.f_globals}'.format(messages|map('string')) }}",
    "{{ '%s' % cycler.__init__ }}",
    "{{ '%s'|format(lipsum.__globals__) }}",
    "{{ '%s' % (cycler|attr('__in' ~ 'it__')) }}",
    # generator frames
    "{{ (messages|map('string')).gi_frame.f_globals }}",
    "{{ (messages|map('string')).gi_code }}",
    "{{ (messages|map('string'))|attr('gi_frame') }}",
    "{{ (range(3)|map('string')|attr('gi_fr' ~ 'ame')).f_back.f_globals }}",
    # attribute= arguments of filters
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ messages|map(attribute='role.__class__.__mro__')|list }}",
    "{{ messages|sort(attribute='__class__') }}",
    "{{ messages|groupby('__class__') }}",
    "{{ messages|selectattr('__class__')|list }}",
    "{{ messages|sum(attribute='__class__') }}",
    "{{ messages|join(attribute='__class__') }}",
    "{{ messages|unique(attribute='__class__')|list }}",
    "{{ messages|map(attribute='__cla' ~ 'ss__')|list }}",
    # loop and namespace objects
    "{% for x in [1] %}{{ loop.__class__ }}{% endfor %}",
    "{% for x in [1] %}{{ loop|attr('_' ~ '_class__') }}{% endfor %}",
    "{% set ns = namespace() %}{{ ns.__init__.__globals__ }}",
    "{% set ns = namespace() %}{{ ns|attr('_Namespace' ~ '__attrs') }}",
    # the context is immutable
    "{{ messages.append({'role': 'system', 'content': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages.pop() }}",
    "{{ messages[0].clear() }}",
    "{{ messages.sort() }}",
    "{{ messages.insert(0, 1) }}",
    "{{ messages[0].setdefault('x', 1) }}",
    "{{ messages[0].popitem() }}",
    # no other template is ever loaded; no extension beyond loopcontrols
    "{% import 'os' as os %}{{ os.system('touch MARKER') }}",
    "{% from 'os' import system %}{{ system('touch MARKER') }}",
    "{% include 'MARKER' %}",
    "{% extends 'MARKER' %}",
    ("{% debug %}", "chat template syntax error"),
    ("{% do messages.append(1) %}", "chat template syntax error"),
    ("{{ config.items() }}", "chat template error: 'config' is undefined"),
]
EXEC = [p if isinstance(p, tuple) else (p, UNSAFE) for p in EXEC]

# Audit events no template may cause (code that ran would need one of them to have any effect).
_DENIED_EVENTS = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
                  "subprocess.Popen", "pty.spawn", "socket.", "ctypes.", "os.remove", "os.unlink", "os.rename",
                  "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.listdir", "os.scandir", "os.putenv",
                  "os.unsetenv", "shutil.", "builtins.input", "webbrowser.", "urllib.")


class _Tripwire:
    """A process-wide audit hook (hooks cannot be removed) that records only while armed."""

    def __init__(self) -> None:
        self.armed, self.events = False, []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.armed:
            return
        writes = event == "open" and (("PWNED" in str(args[0])) or
                                      (isinstance(args[1], str) and any(c in args[1] for c in "wax+")))
        if event.startswith(_DENIED_EVENTS) or writes:
            self.events.append(f"{event}{args!r}"[:200])

    @contextmanager
    def watching(self):
        """Records while armed. The import system's own byte-code writes (a module the render
        imports for the first time, where `PYTHONDONTWRITEBYTECODE` is unset) are not the
        template's doing: they are switched off meanwhile."""
        dont_write = sys.dont_write_bytecode
        self.events, self.armed, sys.dont_write_bytecode = [], True, True
        try:
            yield self.events
        finally:
            self.armed, sys.dont_write_bytecode = False, dont_write


_TRIPWIRE: list[_Tripwire] = []


@pytest.fixture(scope="module")
def tripwire() -> _Tripwire:
    if not _TRIPWIRE:
        _TRIPWIRE.append(_Tripwire())
    return _TRIPWIRE[0]


@pytest.fixture(scope="module")
def tally(request):
    """Counts the cases per group and prints them once the module is done (with or without -s)."""
    counts: Counter = Counter()
    yield counts
    line = (f"chat template SSTI: {sum(counts.values())} cases passed ("
            + ", ".join(f"{k} {n}" for k, n in counts.items()) + "): no payload ran code, every bomb was refused")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else nullcontext():
        print("\n" + line)


def _refused(src: str) -> ChatTemplateError:
    with pytest.raises(ChatTemplateError) as ei:
        ChatFormat(src).render([Message("user", "hi")])   # the constructor compiles (and probes) it too
    return ei.value


@pytest.mark.parametrize("payload, expected", EXEC, ids=[f"exec{i}" for i in range(len(EXEC))])
def test_code_execution_payload_is_refused(payload, expected, tmp_path, tripwire, tally):
    marker = tmp_path / "PWNED"
    with tripwire.watching() as events:
        err = _refused(payload.replace("MARKER", str(marker)))
    assert not marker.exists()
    assert events == []
    msg = str(err)
    assert "\n" not in msg and msg.startswith(expected), msg
    tally["code execution"] += 1


@pytest.mark.parametrize("payload", [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ (cycler|attr('__in' ~ 'it__')|attr('__glo' ~ 'bals__'))['os'].system('touch MARKER') }}",
    "{{ ('{0.__class__}'|attr('format'))(messages) }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
])
def test_payload_in_gguf_metadata_is_refused(payload, tmp_path, tripwire, tally):
    """The real route: `tokenizer.chat_template` of a GGUF, read by our reader, rendered."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.gguf"
    w = GGUFWriter(str(path), arch="gemma4")
    w.add_chat_template(payload.replace("MARKER", str(marker)))
    w.add_array("tokenizer.ggml.tokens", ["<pad>", "<eos>", "<bos>"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 2)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with tripwire.watching() as events, pytest.raises(ChatTemplateError) as ei:
        ChatFormat.from_metadata(GGUFFile(path).metadata).render([Message("user", "hi")])
    assert not marker.exists() and events == []
    assert "\n" not in str(ei.value) and str(ei.value).startswith(UNSAFE), str(ei.value)
    tally["via GGUF"] += 1


# --- resource bombs --------------------------------------------------------------------------------

BOMBS = [
    "{% for i in range(10**9) %}{% endfor %}",
    "{{ range(10**9)|list|length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% for x in [range(100000)] recursive %}{% for y in x %}{% endfor %}{{ loop([range(100000)]) }}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 2**20 }}{% endfor %}",
    # format widths
    "{{ '%0999999999d' % 1 }}",
    "{{ '%.999999999f' % 1.0 }}",
    "{{ '%*d' % (999999999, 1) }}",
    "{{ ('%(a)s' * 100000) % {'a': 'x' * 2**20} }}",
    "{{ '%0999999999d'|format(1) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=999999999) }}",
    "{{ ('{0}' * 100000).format('x' * 2**20) }}",
    "{{ strftime_now('%0999999999Y') }}",
    "{{ strftime_now('%c' * 100000) }}",
    # padding and counts
    "{{ 'x'.center(999999999) }}",
    "{{ 'x'|center(999999999) }}",
    "{{ 'x'.ljust(999999999) }}",
    "{{ 'x'.rjust(999999999) }}",
    "{{ 'x'.zfill(999999999) }}",
    "{{ '\\t'.expandtabs(999999999) }}",
    "{{ 'a\\nb'|indent(999999999) }}",
    "{{ ('\\n' * 2**20)|indent('x' * 2**20) }}",
    "{{ lipsum(n=10**9) }}",
    "{{ range(10)|batch(999999999, 'x')|list|length }}",
    "{{ range(10)|slice(999999999)|list|length }}",
    "{{ {'a': [1, 2]}|tojson(indent=999999999) }}",
    # strings, lists and integers that double
    "{{ 'x' * 10**10 }}",
    "{{ [[0] * 2**20] * 2**20 }}",
    "{{ ((2**4096)**4096)**4096 }}",
    "{% set ns = namespace(x=2**4000) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(l=[0]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
    "{% set ns = namespace(l=[], s='x' * 2**20) %}{% for i in range(100000) %}{% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}",
    "{% set ns = namespace(a=range(100000)|list) %}{% for i in range(12) %}{% set ns.a = [ns.a, ns.a, ns.a, ns.a] %}{% endfor %}{{ ns.a }}",
    "{% set ns = namespace(a=range(100000)|list) %}{% for i in range(12) %}{% set ns.a = [ns.a, ns.a, ns.a, ns.a] %}{% endfor %}{{ ns.a|tojson }}",
    "{% set ns = namespace(a=range(100000)|list) %}{% for i in range(12) %}{% set ns.a = [ns.a, ns.a, ns.a, ns.a] %}{% endfor %}{{ ns.a|string|length }}",
    "{% set ns = namespace(a=range(100000)|list) %}{% for i in range(12) %}{% set ns.a = [ns.a, ns.a, ns.a, ns.a] %}{% endfor %}{{ (ns.a ~ '')|length }}",
    # quadratic string operations
    "{{ ('x' * 2**20)|replace('x', 'x' * 2**20) }}",
    "{{ ('x' * 2**20).replace('x', 'x' * 2**20) }}",
    "{{ ('x' * 2**20)|join('y' * 2**20) }}",
    "{{ ('y' * 2**20).join('x' * 2**20) }}",
    "{{ ('x' * 2**20)|wordwrap(1, wrapstring='y' * 2**20) }}",
    "{{ ('x' * 2**20).translate({120: 'y' * 2**20}) }}",
]

_BOMB_RUNNER = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from models.chat import ChatFormat, ChatTemplateError
results = []
for src in json.load(sys.stdin):
    t0 = time.perf_counter()
    try:
        ChatFormat(src).render([{"role": "user", "content": "hi"}])
        error = None
    except ChatTemplateError as e:
        error = str(e)
    results.append({"error": error, "seconds": time.perf_counter() - t0})
# VmHWM: this process's own peak. ru_maxrss is not: exec records the peak of the memory map it
# replaces (with vfork, pytest's own), so in a long suite it reported pytest's ~2 GB.
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"results": results, "max_rss_mb": hwm / 1024}))
"""


def test_resource_bombs_are_refused(tally):
    """In a child process limited to 2 GB of address space, so a bomb that got through fails with
    MemoryError there (and this test with it) instead of swapping the machine to death."""
    run = subprocess.run([sys.executable, "-c", _BOMB_RUNNER], input=json.dumps(BOMBS), cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    failures = []
    for src, r in zip(BOMBS, report["results"]):
        err = r["error"]
        if err is None or "MemoryError" in err or "\n" in err or r["seconds"] > 6:
            failures.append(f"{src[:80]!r}: {err!r} after {r['seconds']:.2f} s")
        tally["resource bombs"] += 1
    assert not failures, "\n".join(failures)
    assert report["max_rss_mb"] < 1024, report["max_rss_mb"]


# --- the guards keep ordinary templates working ------------------------------------------------------

SEMANTICS = [
    (("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.revindex }}"
      "{{ loop.previtem is defined }}{{ loop.nextitem is defined }}{{ loop.cycle('a','b') }}|{% endfor %}"),
     "1/22FalseTruea|2/2!1TrueFalseb|"),
    ("{% for m in messages if m.role == 'user' %}{{ m.content }}{% else %}none{% endfor %}", "hi"),
    ("{% for m in [] %}x{% else %}empty{% endfor %}", "empty"),
    (("{% for i in range(10) %}{% if i == 3 %}{% continue %}{% endif %}{% if i == 6 %}{% break %}{% endif %}"
      "{{ i }}{% endfor %}"), "01245"),
    ("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k ~ '=' ~ v }};{% endfor %}", "a=1;b=2;"),
    ("{% for item in [{'n':'a','c':[{'n':'b','c':[]}]}] recursive %}{{ item.n }}({{ loop(item.c) }}){% endfor %}",
     "a(b())"),
    (("{{ 'a' ~ 1 ~ none ~ [1,2] ~ {'x': 1} }}|{{ 'ab' + 'cd' }}|{{ [1] + [2] }}|{{ 'x' * 3 }}|{{ 2 ** 10 }}|"
      "{{ 7 % 3 }}|{{ '%s-%d-%5.2f' % ('s', 3, 1.5) }}"),
     "a1None[1, 2]{'x': 1}|abcd|[1, 2]|xxx|1024|1|s-3- 1.50"),
    (("{{ '%(a)s' % {'a': 1} }}|{{ '{0} {x} {0:>5}'.format(1, x=2) }}|{{ '{a}'.format_map({'a': 3}) }}|"
      "{{ 'x'|center(9) }}|{{ 'a\nb'|indent(2, true) }}"),
     "1|1 2     1|3|    x    |  a\n  b"),
    (("{{ 'abcabc'|replace('b', 'XX') }}|{{ 'abc'.replace('b','') }}|{{ ['a','b']|join(',') }}|"
      "{{ ','.join(['a','b']) }}|{{ [{'n':'a'},{'n':'b'}]|join('-', attribute='n') }}|{{ 'a b c d'|wordwrap(3) }}"),
     "aXXcaXXc|ac|a,b|a,b|a-b|a b\nc d"),
    (("{{ '%s'|format(5) }}|{{ range(5)|batch(2)|list }}|{{ range(5)|slice(2)|list }}|{{ [1,2]|string }}|"
      "{{ {'b':[1,2]}|tojson(indent=2) }}|{{ 'a\tb'.expandtabs(4) }}|{{ 'ab'.translate({97: 'zz'}) }}"),
     '5|[[0, 1], [2, 3], [4]]|[[0, 1, 2], [3, 4]]|[1, 2]|{\n  "b": [\n    1,\n    2\n  ]\n}|a   b|zzb'),
    (("{% macro f(x) %}<{{ x }}>{% endmacro %}{{ f(1) }}{% set ns = namespace(s='') %}{% for i in range(3) %}"
      "{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.s }}{{ ns }}"),
     "<1>012<Namespace {'s': '012'}>"),
    ("{{ range(100000)|list|length }}|{{ (range(100000)|list * 10)|length }}|{{ ('x' * 2**20)|length }}", "100000|1000000|1048576"),
]


@pytest.mark.parametrize("src, expected", SEMANTICS, ids=[f"sem{i}" for i in range(len(SEMANTICS))])
def test_guards_keep_template_semantics(src, expected, tally):
    assert ChatFormat(src).render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) \
        == expected
    tally["ordinary templates"] += 1


def test_long_conversation_fits_the_budget(tally):
    """The Gemma 4 template looks ahead from every message (quadratic): the budget grows with it."""
    fmt = ChatFormat((Path(__file__).parents[1] / "data" / "google-gemma-4-31B-it.jinja").read_text())
    msgs = [Message("user" if i % 2 == 0 else "assistant", f"message {i} " * 20) for i in range(300)]
    out = fmt.render(msgs)
    assert out.count("<|turn>user") == 150 and "<turn|>\n<|turn>model\n" in out[-80:]
    tally["ordinary templates"] += 1
