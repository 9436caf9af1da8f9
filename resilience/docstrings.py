"""Adapter classes' ``Args:`` sections, kept equal to the engine configs' own documentation of each field.

The framework adapters take the engine's settings as constructor arguments, and their users read those
arguments' documentation from the class's ``__doc__`` (LightningCLI's ``--help`` through jsonargparse, Sphinx,
``help()``) or from the source. Written out again by hand in each adapter, the same text drifted from the
engine's meaning. So an adapter names the config classes its arguments come from and writes only what differs
for it (its own arguments, another default, another name) with :func:`documented_by`;
``python tools/render_docstrings.py`` renders each section into the adapter's source, and a test fails when a
written section differs from its rendering (an argument documented nowhere, a text changed in the engine).
Nothing here imports a framework.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T", bound=type)
_SECTION = re.compile(r"^(\s*)(Args|Attributes):\s*$")
_ENTRY = re.compile(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")
WIDTH = 112  # the rendered docstring's lines; the class's indentation is not part of ``__doc__`` once rendered


def field_docs(*sources: type) -> dict[str, str]:
    """{field: text} from the Google-style ``Args:`` and ``Attributes:`` sections of ``sources``' docstrings.

    A field documented by several sources takes the first one's text; each text is one line.
    """
    docs: dict[str, str] = {}
    for source in sources:
        for name, text in _parse(inspect.cleandoc(source.__doc__ or "")).items():
            docs.setdefault(name, text)
    return docs


def _parse(doc: str) -> dict[str, str]:
    """The entries of a cleaned docstring's sections: ``name: text`` at the first entry's indentation, and the
    deeper lines after it (a continuation that looks like an entry is still a continuation)."""
    entries: dict[str, list[str]] = {}
    section_indent: int | None = None
    entry_indent: int | None = None
    current: list[str] = []
    for line in doc.splitlines():
        indent = len(line) - len(line.lstrip())
        header = _SECTION.match(line)
        if header:
            section_indent, entry_indent = len(header.group(1)), None
            continue
        if section_indent is None or not line.strip():
            continue
        if indent <= section_indent:  # the section ended
            section_indent = None
            continue
        entry = _ENTRY.match(line.strip())
        if entry and (entry_indent is None or indent == entry_indent):
            entry_indent = indent
            current = entries.setdefault(entry.group(1), [])
            current.append(entry.group(2))
        else:
            current.append(line.strip())
    return {name: " ".join(" ".join(parts).split()) for name, parts in entries.items()}


def parameters(cls: type) -> list[str]:
    """The names ``cls(...)`` takes, in its signature's order (a dataclass's: its fields with ``init``)."""
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, item in inspect.signature(cls).parameters.items() if item.kind in plain]


def render_args(
    cls: type,
    sources: tuple[type, ...],
    own: Mapping[str, str] | None = None,
    renamed: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
    defaults: bool = False,
) -> str:
    """The ``Args:`` section of ``cls``: a text per parameter, from ``own`` (the adapter's own words, where its
    meaning differs or the engine has no such field), else the sources' field of that name (``renamed``: the
    parameter -> the field's name, which the engine's texts then call by the parameter's), then ``notes``
    appended (e.g. a default the adapter fills in), then with ``defaults`` the parameter's default value.

    Raises ValueError for a parameter with no text, and for ``own``, ``renamed`` or ``notes`` naming no parameter
    (a parameter renamed or removed would leave stale text behind).
    """
    own, renamed, notes = dict(own or {}), dict(renamed or {}), dict(notes or {})
    names = parameters(cls)
    stale = sorted((set(own) | set(renamed) | set(notes)) - set(names))
    if stale:
        raise ValueError(f"{cls.__qualname__} documents {', '.join(stale)}, which it does not take")
    docs = field_docs(*sources)
    shown = _defaults(cls) if defaults else {}
    lines = ["Args:"]
    for name in names:
        text = own.get(name) or docs.get(renamed.get(name, name))
        if not text:
            where = ", ".join(source.__qualname__ for source in sources) or "no engine config"
            raise ValueError(
                f"{cls.__qualname__}({name}=...) is documented nowhere: not in {where}, nor in the adapter's own "
                "texts; document it there"
            )
        default = f"Default: {_shown(shown[name])}." if name in shown else ""
        text = " ".join(f"{_renamed(text, renamed)} {notes.get(name, '')} {default}".split())
        lines.append(
            textwrap.fill(
                text, WIDTH, initial_indent=f"    {name}: ", subsequent_indent=" " * 8, break_on_hyphens=False
            )
        )
    return "\n".join(lines)


def _defaults(cls: type) -> dict[str, object]:
    """Each parameter's default that is a value: a dataclass field's ``metadata["default"]`` where it has one
    (:func:`resilience.env_settings.setting`: its ``None`` means "from the environment"), else the signature's;
    ``None`` and ``{}`` show none (the text says what they mean)."""
    found = {name: item.default for name, item in inspect.signature(cls).parameters.items()}
    for item in getattr(cls, "__dataclass_fields__", {}).values():
        if "default" in item.metadata:
            found[item.name] = item.metadata["default"]
    return {name: value for name, value in found.items() if value not in (None, {}, inspect.Parameter.empty)}


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()  # as an environment variable takes it
    return f"{value:g}" if isinstance(value, float) else f'``"{value}"``' if isinstance(value, str) else str(value)


def _renamed(text: str, renamed: Mapping[str, str]) -> str:
    """``text`` with the engine's field names in its code literals (as in ``<local_root>/step-<N>/``) made the
    adapter's."""
    adapter = {engine: name for name, engine in renamed.items()}
    return re.sub(r"``.+?``", lambda code: re.sub(r"\w+", lambda word: adapter.get(word[0], word[0]), code[0]), text)


@dataclass(frozen=True)
class ArgsDoc:
    """Where an adapter's ``Args:`` section comes from: :func:`render_args`' arguments after the class."""

    sources: tuple[type, ...]
    own: Mapping[str, str] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)
    defaults: bool = False

    def render(self, cls: type) -> str:
        return render_args(cls, self.sources, self.own, self.renamed, self.notes, self.defaults)


def documented_by(
    *sources: type,
    own: Mapping[str, str] | None = None,
    renamed: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
    defaults: bool = False,
) -> Callable[[T], T]:
    """Class decorator: records where ``cls``'s ``Args:`` section comes from (``__args_doc__``); the docstring
    itself is written in the source (:func:`write_section`), so nothing is rendered at import time."""

    spec = ArgsDoc(sources, dict(own or {}), dict(renamed or {}), dict(notes or {}), defaults)

    def record(cls: T) -> T:
        cls.__args_doc__ = spec  # type: ignore[attr-defined]
        return cls

    return record


def args_doc(cls: type) -> ArgsDoc:
    """Where ``cls``'s section comes from, as :func:`documented_by` recorded it."""
    spec = cls.__dict__.get("__args_doc__")
    if not isinstance(spec, ArgsDoc):
        raise TypeError(f"{cls.__qualname__} is not decorated with documented_by")
    return spec


def written_section(cls: type) -> str:
    """The ``Args:`` section of ``cls``'s docstring as written (cleaned of its indentation); empty if none."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    at = doc.find("\nArgs:\n")
    return doc[at + 1 :] if at >= 0 else ""


def write_section(cls: type) -> bool:
    """Render ``cls``'s section into its source file, after the docstring's own text; whether the file changed."""
    path = inspect.getsourcefile(cls)
    assert path is not None
    with open(path, encoding="utf-8") as source:
        text = source.read()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    doc = node.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        raise TypeError(f"{cls.__qualname__} has no docstring to write its Args section into")
    indent = " " * doc.col_offset
    intro = inspect.cleandoc(doc.value.value).split("\nArgs:\n")[0].rstrip()
    body = textwrap.indent(f"{intro}\n\n{args_doc(cls).render(cls)}", indent).lstrip()
    lines = text.splitlines(keepends=True)
    new = f'{indent}"""{body}\n{indent}"""\n'
    if new == "".join(lines[doc.lineno - 1 : doc.end_lineno]):
        return False
    lines[doc.lineno - 1 : doc.end_lineno] = [new]
    with open(path, "w", encoding="utf-8") as out:
        out.write("".join(lines))
    return True
