"""Reading docker-compose.yml and the Dockerfile the way Docker does, for tests without an engine.

Only what the project's own files use is supported: compose variable interpolation
(``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?message}``, ``$VAR``, ``$$``),
YAML merge keys, both forms of ``environment``, and the Dockerfile's ``WORKDIR``, ``ENV``,
``COPY``, ``USER`` and ``FROM``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def interpolate_text(text: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and (value is None or (op == ":?" and not value)):
            raise InterpolationError(f"{name} is required: {arg}")
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Interpolates every string of a loaded compose document, as compose does before using it."""
    if isinstance(value, str):
        return interpolate_text(value, env)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def variables(value: Any) -> set[tuple[str, str | None]]:
    """Every (variable, default or None) the document interpolates."""
    found: set[tuple[str, str | None]] = set()
    if isinstance(value, str):
        for m in _VARIABLE.finditer(value):
            name = m.group("braced") or m.group("bare")
            if name:
                found.add((name, m.group("arg") if m.group("op") in (":-", "-") else None))
    elif isinstance(value, list):
        for v in value:
            found |= variables(v)
    elif isinstance(value, dict):
        for v in value.values():
            found |= variables(v)
    return found


def load_raw(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    with path.open() as f:
        document = yaml.safe_load(f)  # resolves the YAML merge keys (<<: *anchor)
    assert isinstance(document, dict)
    return document


def load(env: Mapping[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    document = interpolate(load_raw(path), env)
    assert isinstance(document, dict)
    return document


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's environment as a dict, from either compose form (mapping or KEY=VALUE list)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        pairs = (item.split("=", 1) if "=" in item else (item, "") for item in raw)
        return {k: v for k, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def command(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def seconds(duration: str | int | float) -> float:
    """A compose duration ("2s", "1m30s", "500ms") in seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


@dataclass
class Dockerfile:
    base: str = ""
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, destination)
    user: str = ""
    runs: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    """The instructions of a Dockerfile that say where files land and what the environment is."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = Dockerfile()
    args: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        elif instruction == "FROM":
            result.base = rest
        elif instruction == "WORKDIR":
            result.workdir = str(Path(result.workdir) / rest)
        elif instruction == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                result.env[name] = interpolate_text(value, {**args, **result.env})
        elif instruction == "COPY":
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            result.copies.append((words[:-1], words[-1]))
        elif instruction == "USER":
            result.user = rest
        elif instruction == "RUN":
            result.runs.append(interpolate_text(rest, args))
        elif instruction == "CMD":
            result.cmd = command(yaml.safe_load(rest) if rest.startswith("[") else rest)
    return result


def image_path(build: Dockerfile, relative: str) -> str:
    """Where a path relative to WORKDIR (as a container command names it) comes from in the
    build context, or "" when no COPY puts it into the image."""
    target = Path(build.workdir) / relative
    for sources, destination in build.copies:
        dest = Path(build.workdir) / destination
        for source in sources:
            landed = dest / Path(source).name if destination.endswith("/") or len(sources) > 1 else dest
            if target == landed:
                return source
            if target.is_relative_to(landed):
                return str(Path(source) / target.relative_to(landed))
    return ""
