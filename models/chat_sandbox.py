"""The Jinja sandbox that renders chat templates from untrusted GGUF files (used by models/chat.py).

HF transformers' environment (``ImmutableSandboxedEnvironment``, trim/lstrip blocks, loopcontrols,
``raise_exception``, ``tojson``, ``strftime_now``), hardened: any reach for Python internals raises
``ChatTemplateError`` (a static check in `compile_template`, plus the sandbox for names built at run
time) instead of printing a silent "", and one render has a budget (loop iterations and calls,
seconds, characters built) with every amplifying operation (``*``, ``**``, ``+``, ``~``, ``%``,
``str.format`` widths, ``center``/``indent``/``replace``/``join``/...) measured before it allocates.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import re
import time
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Mapping

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

__all__ = ["ChatTemplateError", "compile_template", "render_template", "render_budget"]

# What one render of an untrusted template may do. The real Gemma 4 template with tools and a long
# conversation stays orders of magnitude below each (a few thousand steps, < 1 MB built).
_MAX_SEQ = 1 << 20       # largest repetition (`*`), width, padding or count a template may ask for
_MAX_STR = 1 << 26       # longest string one operation, or the whole prompt, may be (64M chars)
_MAX_STEPS = 1 << 18     # loop iterations plus calls (macros, methods) in one render,
_MAX_SECONDS = 2.0       # its wall clock, checked at every step,
_MAX_BUILT = 1 << 25     # and the characters its string-building operations produce; all three grow
                         # with the conversation (`_Budget`)
_MAX_BITS = 1 << 16      # largest integer `*` and `**` may build


class ChatTemplateError(ValueError):
    """The chat template is unsafe, malformed, or failed while rendering (one-line message)."""


def _err(prefix: str, exc: BaseException | str) -> ChatTemplateError:
    text = " ".join(str(exc).split()) or type(exc).__name__   # always a single line
    return ChatTemplateError(f"{prefix}: {text}")


# --- the per-render budget -------------------------------------------------------------------------

class _Budget:
    """What the current render may still spend (set for the length of one `render_template`).

    The budget grows with the square of the messages: the Gemma 4 template looks ahead from every
    message (500 messages take 130K steps and 1.3 s, 2000 take 2M steps and 20 s), so a long
    conversation gets room in proportion while a hostile template on one message stops within ~2 s
    and ~128 MB of strings."""

    def __init__(self, n_items: int = 1, share: float = 1.0) -> None:
        scale = share * (1 + (n_items / 256) ** 2)
        self.steps, self.chars = int(_MAX_STEPS * scale), int(_MAX_BUILT * scale)
        self.deadline = time.monotonic() + _MAX_SECONDS * scale


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _step() -> None:
    """One loop iteration or call: nested `range` loops and exponential macro recursion stop here."""
    b = _BUDGET.get()
    if b is not None:
        b.steps -= 1
        if b.steps < 0:
            raise SecurityError("too many loop iterations and calls")
        if time.monotonic() > b.deadline:
            raise SecurityError("rendering took too long")


def _limit(n: Any, what: str) -> None:
    if isinstance(n, int) and n > _MAX_SEQ:
        raise SecurityError(f"{what} {n} is larger than {_MAX_SEQ}")


def _build(n: int, what: str) -> None:
    """Measure a string or list before it is built: one may hold _MAX_STR, a render may build _MAX_BUILT."""
    if n > _MAX_STR:
        raise SecurityError(f"{what} of {n} characters is longer than {_MAX_STR}")
    b = _BUDGET.get()
    if b is not None:
        b.chars -= n
        if b.chars < 0:
            raise SecurityError("the template built too many characters")


def _size(value: Any, limit: int = _MAX_STR) -> int:
    """Lower bound of len(str(value)), counting a shared sub-list once per reference (`[[0] * 2**20]
    * 2**20` takes 16 MB but prints 2**40 characters). Stops past `limit`, or past _MAX_SEQ values
    visited (then reports limit + 1: no chat template prints a structure of a million values), so
    a check costs at most ~0.3 s."""
    total, todo = 0, [value]
    for _ in range(_MAX_SEQ):
        if not todo or total > limit:
            return total
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            if len(v) > _MAX_SEQ:
                break
            total += 1
            todo.extend(v.items() if isinstance(v, dict) else v)
        elif isinstance(v, Namespace):
            todo.append(getattr(v, "_Namespace__attrs", {}))   # printed as <Namespace {...}>
        else:
            total += 1
    return total if not todo else max(total, limit + 1)


# --- operations measured before they build: %, str.format, str methods, * ** + ---------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _number(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18   # int() refuses 4300+ digits


def _check_percent(fmt: str, args: Any) -> None:
    """`fmt % args` (and the `format` filter): widths bounded, output measured before it is built."""
    values = tuple(args.values()) if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    biggest = max((_size(v) for v in values), default=0)
    n_bytes, star = len(fmt), False
    for m in _PERCENT_SPEC.finditer(fmt):
        for g in m.groups():
            star |= g == "*"
            if g and g != "*":
                _limit(_number(g), "format width")
                n_bytes += _number(g)
        n_bytes += biggest   # a mapping lets every field print the biggest value
    if star:
        for v in values:
            _limit(v, "format width")
            n_bytes += v if isinstance(v, int) and v > 0 else 0
    _build(n_bytes, "formatted string")


class _BoundedFormatter(SandboxedFormatter):
    """`str.format`: the sandbox's attribute checks, plus widths and output measured per field."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        widths = [_number(d) for d in re.findall(r"\d+", format_spec)]
        for w in widths:
            _limit(w, "format width")
        _build(_size(value) + sum(widths), "formatted field")
        return super().format_field(value, format_spec)


def _replaced_len(s: str, old: str, new: str, count: Any) -> int:
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _joined_len(items: list, sep: str) -> int:
    n = len(sep) * max(len(items) - 1, 0)
    return n if n > _MAX_STR else n + sum(len(i) if isinstance(i, str) else _size(i) for i in items)


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Bound the str methods whose output can outgrow their input; returns the (materialized) args."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _limit(args[0], f"str.{name} width")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        _limit(size, "tab size")
        _build(len(s) + s.count("\t") * max(int(size), 0), "expanded text")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _build(_replaced_len(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1)),
               "replaced text")
    elif name == "join" and args:
        items = list(args[0])
        _build(_joined_len(items, s), "joined text")
        args = (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _build(len(s) * max(longest, 1), "translated text")
    return args


class _Sandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox, but unsafe attribute access raises, and one render cannot exhaust memory or CPU:
    loops, calls and the operators that build strings, lists and integers are measured first."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The stock sandbox returns an Undefined that prints as "" and hides the attempt.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > _MAX_BITS:
                    raise SecurityError(f"integer product larger than {_MAX_BITS} bits is not allowed")
            else:
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if _size(seq, _MAX_SEQ) * n > _MAX_SEQ:
                        raise SecurityError(f"sequence repetition longer than {_MAX_SEQ} is not allowed")
                    _build(_size(seq) * max(n, 0), "repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(left.bit_length(), 1) * right > _MAX_BITS:
                raise SecurityError(f"power larger than {_MAX_BITS} bits is not allowed")
        elif operator == "+" and isinstance(left, str) and isinstance(right, str):
            _build(len(left) + len(right), "concatenation")
        elif operator == "+" and isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            _limit(len(left) + len(right), "list length")   # what is printed is measured when printed
            _build(len(left) + len(right), "list")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _step()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(owner, getattr(obj, "__name__", ""), args, kwargs)
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:   # not a str.format / str.format_map
            return None
        fmt, is_map, formatter = value.__self__, value.__name__ == "format_map", _BoundedFormatter(self)

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return str(formatter.vformat(fmt, args, kwargs))
        return bounded_format


# --- globals and filters ---------------------------------------------------------------------------

def _raise_exception(message: str = "") -> None:
    raise TemplateError(message)   # HF templates call raise_exception('...') to reject input


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:   # HF's tojson
    if indent is not None and (indent if isinstance(indent, int) else len(str(indent))) > 64:
        raise SecurityError("tojson indent larger than 64 is not allowed")
    _build(_size(x), "JSON text")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    if len(fmt) > 256 or re.search(r"%[-_0^#]*\d{3}", fmt):   # glibc pads `%0999999999Y` as asked
        raise SecurityError("strftime_now format longer than 256 characters or wider than 99")
    return datetime.datetime.now().strftime(fmt)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # jinja's argument names
    _limit(int(n) * int(max) * 16, "lipsum size")
    return generate_lorem_ipsum(n, html, min, max)


def _loop_steps(iterable: Any) -> Any:
    """Every `{% for %}` iterable (and every `loop(...)` recursion) goes through here."""
    for item in iterable:
        _step()
        yield item


def _concat(parts: list) -> str:
    """`a ~ b ~ c`: measured before it is built (a doubling loop otherwise reaches GBs in 30 steps)."""
    _build(sum(_size(p) for p in parts), "concatenation")
    return "".join(map(str, parts))


def _printable(value: Any, *_: Any, **__: Any) -> Any:
    """Every `{{ value }}` (the environment's finalize), `|string`, `|pprint`: a list sharing
    sub-lists can print to far more characters than it takes bytes in memory."""
    if not isinstance(value, str) and _size(value) > _MAX_STR:
        raise SecurityError(f"printing a value longer than {_MAX_STR} characters is not allowed")
    return value


def _bounded_str(value: Any) -> str:
    return str(_printable(value))


def _width_check(value: Any, width: Any = 80, *_: Any, **__: Any) -> Any:        # center
    _limit(width, "width")
    return value


def _indent_check(s: Any, width: Any = 4, *_: Any, **__: Any) -> Any:
    w = width if isinstance(width, int) else len(_bounded_str(width))
    _limit(w, "indent width")
    s = _bounded_str(s)
    _build(len(s) + (s.count("\n") + 1) * max(w, 0), "indented text")
    return s


def _count_check(value: Any, count: Any = 1, *_: Any, **__: Any) -> Any:         # batch, slice
    _limit(count, "batch/slice count")
    return value


def _replace_check(s: Any, old: Any = "", new: Any = "", count: Any = None) -> Any:
    s = _bounded_str(s)
    _build(_replaced_len(s, _bounded_str(old), _bounded_str(new), count), "replaced text")
    return s


def _join_check(value: Any, d: Any = "", attribute: Any = None) -> Any:
    items = list(value)
    if attribute is None:
        _build(_joined_len(items, _bounded_str(d)), "joined text")
    else:   # the values are looked up by the filter; the separators alone are measured here
        _build(len(_bounded_str(d)) * max(len(items) - 1, 0), "joined text")
    return items


def _wordwrap_check(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                    *_: Any, **__: Any) -> Any:
    s = _bounded_str(s)
    lines = len(s) // max(int(width), 1) + s.count("\n") + 1
    _build(len(s) + lines * len(wrapstring or "\n"), "wrapped text")
    return s


def _format_check(value: Any, *args: Any, **kwargs: Any) -> Any:
    _check_percent(_bounded_str(value), kwargs or args)
    return value


_FILTER_CHECKS: dict[str, Callable[..., Any]] = {
    "center": _width_check, "indent": _indent_check, "batch": _count_check, "slice": _count_check,
    "replace": _replace_check, "join": _join_check, "wordwrap": _wordwrap_check, "format": _format_check,
    "string": _printable, "pprint": _printable,
}


def _guarded(func: Callable[..., Any], check: Callable[..., Any]) -> Callable[..., Any]:
    """Run `check(value, *args)` before the filter; it may hand back a materialized value."""
    skip = 1 if hasattr(func, "jinja_pass_arg") else 0   # context / eval context / environment first

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        value = check(*args[skip:], **kwargs)
        return func(*args[:skip], value, *args[skip + 1:], **kwargs)
    return guarded


# --- the environment, and compiling a template -----------------------------------------------------

class _Guards(NodeTransformer):
    """Routes every loop iterable, `loop(...)` recursion and `~` through the budgeted filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _filter(node.iter, "_sandbox_steps")
        return node

    def visit_Call(self, node: nodes.Call) -> nodes.Node:
        self.generic_visit(node)
        if isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.args:
            node.args[0] = _filter(node.args[0], "_sandbox_steps")
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _filter(nodes.List(node.nodes, lineno=node.lineno), "_sandbox_concat")


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_printable)
for _name, _check in _FILTER_CHECKS.items():
    _ENV.filters[_name] = _guarded(_ENV.filters[_name], _check)
_ENV.filters.update(tojson=_tojson, _sandbox_steps=_loop_steps, _sandbox_concat=_concat)
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, lipsum=_lipsum)


def compile_template(source: str) -> Any:
    """Parse, statically reject any `_`-prefixed attribute/item/attr() access and `__`-prefixed name
    (`__builtins__`, `__import__`), add the budget guards, then compile."""
    try:
        tree = _ENV.parse(source)
    except TemplateError as e:
        raise _err("chat template syntax error", e) from None
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter, nodes.Name)):
        name: Any = None
        if isinstance(node, nodes.Name):
            name = node.name if node.name.startswith("__") else None
        elif isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            name = node.arg.value
        elif isinstance(node, nodes.Filter) and node.name == "attr" and node.args \
                and isinstance(node.args[0], nodes.Const):
            name = node.args[0].value
        if isinstance(name, str) and name.startswith("_"):
            raise ChatTemplateError(f"unsafe chat template: access to {name!r} (line {node.lineno}) is not allowed")
    for node in tree.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
        tag = {"FromImport": "from ... import"}.get(type(node).__name__, type(node).__name__.lower())
        raise ChatTemplateError(f"unsafe chat template: '{tag}' (line {node.lineno}) is not allowed: "
                                "a chat template loads no other template")
    tree = _Guards().visit(tree)
    tree.set_environment(_ENV)
    try:
        return _ENV.from_string(tree)
    except TemplateError as e:
        raise _err("chat template syntax error", e) from None


# --- rendering ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def render_budget(n_items: int = 1, share: float = 1.0) -> Iterator[None]:
    """Renders inside the block share one budget (`_Budget(n_items, share)`) instead of each taking
    its own: `ChatFormat` probes a template with a tenth of the usual one."""
    token = _BUDGET.set(_Budget(n_items, share))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def render_template(tmpl: Any, ctx: Mapping[str, Any], n_items: int) -> str:
    """One render of a `compile_template` result under the current budget (a fresh one for
    `n_items` messages if none is set); every failure is a one-line ChatTemplateError."""
    token = _BUDGET.set(_BUDGET.get() or _Budget(n_items))
    try:
        out, total = [], 0
        for piece in tmpl.generate(ctx):
            total += len(piece)
            if total > _MAX_STR:
                raise SecurityError(f"prompt longer than {_MAX_STR} characters")
            out.append(piece)
        return "".join(out)
    except SecurityError as e:
        raise _err("unsafe chat template", e) from None
    except TemplateError as e:           # raise_exception(...), undefined variables, ...
        raise _err("chat template error", e) from None
    except Exception as e:  # noqa: BLE001 - TypeError, RecursionError, OverflowError... from the template
        raise _err(f"chat template failed ({type(e).__name__})", e) from None
    finally:
        _BUDGET.reset(token)
