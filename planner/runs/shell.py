"""The Hydra overrides of a trainer's launch script, read as a shell would expand them, never run.

Users keep their runs as shell scripts: variables set at the top (`TP=4`, `export N=16`,
`EP=${EP:-8}`), arithmetic (`$(((max_prompt + max_response) * 3))`), bash arrays of overrides
(`ACTOR=( key=value ... )` then `"${ACTOR[@]}"`), lines continued with a backslash, and one command
(`python3 -m verl.trainer.main_ppo ... key=value ... $@`). This reads the assignments in order,
expands `$NAME`, `${NAME}`, `${NAME:-default}`, `${NAME[@]}` and integer arithmetic, and returns the
command's `key=value` tokens. Nothing is executed: a command substitution `$(...)`, a variable the
script never sets (an environment variable of the user's shell) or an expression it cannot
evaluate leaves its override out, and a note names it, so the trainer's default stands in.
"""

from __future__ import annotations

import ast
import operator
import re
import shlex

__all__ = ["script_overrides", "looks_like_script"]

_ASSIGN = re.compile(r"^(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)=(.*)$", re.S)
_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)(\[@\]|\[\*\])?(?::?-((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_]\w*))")
_ARITH = re.compile(r"\$\(\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)\)")  # $(( ... )) with up to two levels of parentheses inside
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv,
        ast.Mod: operator.mod}  # fmt: skip


class Unresolved(Exception):
    """A value the script does not determine."""


def looks_like_script(text: str) -> bool:
    """A launch script rather than a plain file of overrides: shell variables or a command line."""
    return bool(re.search(r"(^|\s)(python3?|torchrun|ray)\b|\$\{?[A-Za-z_]|^\s*(export\s+)?[A-Za-z_]\w*=", text, re.M))


def _arith(expr: str) -> int:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise Unresolved(f"$(({expr})): not integer arithmetic")

    try:
        return value(ast.parse(expr.strip(), mode="eval").body)
    except SyntaxError:
        raise Unresolved(f"$(({expr})): not integer arithmetic") from None


def _expand(text: str, env: dict[str, str], arrays: dict[str, list[str]]) -> str:
    """`text` with its variables and arithmetic expanded; Unresolved where the script does not say."""
    if "$(" in text.replace("$((", ""):
        raise Unresolved(f"{text.strip()[:60]}: a command substitution $(...) is not run")

    def arith(m):
        inner = _VAR.sub(var, m.group(1))  # ${A}, $A inside the arithmetic
        inner = re.sub(r"\b([A-Za-z_]\w*)\b", lambda v: _scalar(v.group(1), env, arrays), inner)
        return str(_arith(inner))

    def var(m):
        name, index, default, bare = m.group(1) or m.group(4), m.group(2), m.group(3), m.group(4)
        if index:
            if name not in arrays:
                raise Unresolved(f"${{{name}[@]}}: the array is not set in the script")
            return " ".join(shlex.quote(t) for t in arrays[name])
        if name in env:
            return env[name]
        if default is not None and not bare:
            return _expand(default, env, arrays)
        raise Unresolved(f"${name}: not set in the script (an environment variable of the shell that runs it?)")

    return _VAR.sub(var, _ARITH.sub(arith, text))


def _scalar(name: str, env: dict[str, str], arrays) -> str:
    if name not in env:
        raise Unresolved(f"${name}: not set in the script")
    return env[name]


def _statements(text: str) -> list[str]:
    """Logical lines: continuations joined, comments dropped, an array assignment `NAME=( ... )` one
    statement however many lines it spans."""
    lines = re.sub(r"\\\r?\n", " ", text).splitlines()
    out, pending = [], None
    for line in lines:
        stripped = line.strip()
        if pending is not None:
            pending += " " + _uncommented(stripped)
            if ")" in _uncommented(stripped):
                out.append(pending)
                pending = None
            continue
        if not stripped or stripped.startswith("#"):
            continue
        if re.match(r"^[A-Za-z_]\w*=\($", stripped) or (re.match(r"^[A-Za-z_]\w*=\(", stripped) and ")" not in _uncommented(stripped)):
            pending = stripped
            continue
        out.append(stripped)
    if pending is not None:
        out.append(pending)
    return out


def _words(line: str) -> list[str]:
    """The shell words of a command line, unexpanded: split at unquoted blanks outside `$(( ))`,
    `$( )` and `${ }`, quotes kept (a shell reads `key=$((a + b))` as one word)."""
    words, word, depth, quote, i = [], "", 0, None, 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'" and depth == 0:
            quote = c
        elif line.startswith("$((", i) or line.startswith("$(", i) or line.startswith("${", i):
            opener = "$((" if line.startswith("$((", i) else line[i : i + 2]
            word += opener
            depth += len(opener) - 1
            i += len(opener)
            continue
        elif c in "({" and depth:
            depth += 1
        elif c in ")}" and depth:
            depth -= 1
        elif c.isspace() and depth == 0:
            if word:
                words.append(word)
            word = ""
            i += 1
            continue
        word += c
        i += 1
    if word:
        words.append(word)
    return words


def _uncommented(line: str) -> str:
    return "" if line.startswith("#") else line.split(" #", 1)[0]


def script_overrides(text: str, command: str = "main_ppo") -> tuple[dict[str, str], list[str]]:
    """(key -> value text, notes) of the `key=value` tokens of the script's `command` line (the
    last line naming it; a script of bare overrides: every such token), variables expanded."""
    env: dict[str, str] = {}
    arrays: dict[str, list[str]] = {}
    notes: list[str] = []
    commands = []
    for statement in _statements(text):
        m = _ASSIGN.match(statement)
        if m and not re.search(r"\s(python3?|torchrun)\b", statement):
            name, value = m.group(1), m.group(2).strip()
            try:
                if value.startswith("(") and value.rstrip().endswith(")"):
                    body = value.strip()[1:-1]
                    arrays[name] = shlex.split(_expand(body, env, arrays), comments=True)
                else:
                    words = shlex.split(_expand(value, env, arrays), comments=True)
                    env[name] = " ".join(words)
            except Unresolved as exc:
                env.pop(name, None)
                notes.append(f"{name}: {exc}")
            except ValueError as exc:
                notes.append(f"{name}: not read ({exc})")
            continue
        if command in statement:
            commands.append(statement)
    lines = commands[-1:] or [s for s in _statements(text) if "=" in s and not _ASSIGN.match(s)]
    overrides: dict[str, str] = {}
    for line in lines:
        for raw in _words(line):
            key, sep, value = raw.partition("=")
            key = key.lstrip("+~")
            array = re.fullmatch(r'"?\$\{([A-Za-z_]\w*)\[[@*]\]\}"?', raw)
            if array:  # "${NAME[@]}": the array's words, each its own token
                if array.group(1) not in arrays:
                    notes.append(f"${{{array.group(1)}[@]}}: the array is not set in the script")
                for token in arrays.get(array.group(1), []):
                    k, s2, v = token.partition("=")
                    if s2 and "." in k:
                        overrides[k.lstrip("+~")] = v
                continue
            if not sep or "." not in key or key.startswith("-"):
                continue
            try:
                words = shlex.split(_expand(value, env, arrays))
                if any("$" in w for w in words):  # an expansion this reader does not know (it would be a shell's)
                    raise Unresolved(f"{value}: not expanded")
            except Unresolved as exc:
                notes.append(f"{key}: {exc}: the trainer's default is used")
                continue
            except ValueError as exc:
                notes.append(f"{key}: not read ({exc}): the trainer's default is used")
                continue
            overrides[key] = " ".join(words)
    return overrides, notes
