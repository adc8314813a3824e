"""Loading untrusted pickles that hold only builtin containers and scalars (what
``torch.cuda.memory._dump_snapshot`` writes): :func:`load_builtins`.

Two guards, both needed:

- the pickle is loaded by a :class:`pickle.Unpickler` whose ``find_class`` refuses every
  global and whose ``persistent_load`` refuses every persistent id, so no code is imported or
  called: only dicts, lists, tuples, sets, frozensets, str, bytes, bytearray, int, float,
  bool and None come out;
- before that, the opcodes are walked once (without building anything) to refuse what would
  crash or exhaust the interpreter while loading even those: tuples nested more than
  :data:`MAX_TUPLE_DEPTH` deep (hashing one as a dict key or set member recurses in C once
  per level and overflows the C stack: a 1 MB pickle kills the process), memo indices beyond
  the next free one (the unpickler sizes its memo by the largest index), unknown opcodes,
  lengths past the end of the data and stacks that underflow.

Imports nothing of the package (a bottom layer).
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any, List, Tuple

MAX_TUPLE_DEPTH = 64


class PickleRefused(ValueError):
    """The pickle needs something this loader does not allow, or is not a pickle (the
    message says what)."""


class NotAPickle(PickleRefused):
    """The data is not a pickle: unknown opcodes, truncated, inconsistent."""


def _short(text: Any, limit: int = 80) -> str:
    text = text if isinstance(text, str) else repr(text)
    return text if len(text) <= limit else text[:limit] + "..."


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise PickleRefused(f"the pickle needs the global {_short(module)}.{_short(name)}; "
                            f"only builtin containers and scalars are accepted")

    def persistent_load(self, pid: Any) -> Any:
        raise PickleRefused("the pickle holds a persistent id; only builtin containers and "
                            "scalars are accepted")


# What each opcode does to the walk's stack (of tuple depth bounds), by opcode byte:
# (category, argument).
_INVALID, _PUSH, _PUSH_COUNTED, _PUSH_LINES, _MARK, _TO_MARK, _POP_PUSH, _TUPLE, _TUPLE_MARK, \
    _PUT, _PUT_LINE, _MEMOIZE, _GET, _GET_LINE, _DUP, _SKIP, _POP, _STOP = range(18)
_WIDTHS = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


# Opcodes whose effect on the walk is named rather than read from pickletools' stack notes.
_NAMED = {"MARK": _MARK, "TUPLE": _TUPLE_MARK, "PUT": _PUT_LINE, "MEMOIZE": _MEMOIZE,
          "GET": _GET_LINE, "DUP": _DUP, "POP": _POP, "STOP": _STOP}
_NAMED_FIXED = {"BINPUT": _PUT, "LONG_BINPUT": _PUT, "BINGET": _GET, "LONG_BINGET": _GET,
                "PROTO": _SKIP, "FRAME": _SKIP}


def _categories() -> Tuple[List[int], List[Any], List[str]]:
    category, argument, names = [_INVALID] * 256, [0] * 256, ["?"] * 256
    for op in pickletools.opcodes:
        code, name, arg = ord(op.code), op.name, op.arg
        names[code] = name
        before = op.stack_before
        fixed = 0 if arg is None else arg.n
        if name in _NAMED:
            category[code] = _NAMED[name]
        elif name in _NAMED_FIXED:  # takes the opcode's fixed-size argument
            category[code], argument[code] = _NAMED_FIXED[name], fixed
        elif name in ("EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            category[code], argument[code] = _TUPLE, len(before)
        elif pickletools.markobject in before:  # pops to the mark, then the items under it
            category[code] = _TO_MARK
            argument[code] = (before.index(pickletools.markobject), len(op.stack_after),
                              0 if arg is None else 2 if arg.name.endswith("_pair") else 1)
        elif before:  # pops items, pushes the result(s)
            if arg is None or arg.n >= 0:  # (other shapes stay unknown: refused)
                category[code], argument[code] = _POP_PUSH, (len(before), len(op.stack_after),
                                                              fixed)
        elif arg is not None and arg.n == pickletools.UP_TO_NEWLINE:
            category[code] = _PUSH_LINES
            argument[code] = 2 if arg.name.endswith("_pair") else 1
        elif arg is not None and arg.n < 0:
            category[code], argument[code] = _PUSH_COUNTED, _WIDTHS[arg.n]
        else:
            category[code], argument[code] = _PUSH, fixed
    return category, argument, names


_CATEGORY, _ARGUMENT, _NAMES = _categories()


def _memo_index(text: bytes, where: int) -> int:
    digits = text.strip()
    if not digits.isdigit() or len(digits) > 12:
        raise NotAPickle(f"not a pickle: memo index {_short(digits)} at byte {where}")
    return int(digits)


def _line_end(data: bytes, pos: int, lines: int, where: int) -> int:
    for _ in range(lines):
        newline = data.find(b"\n", pos)
        if newline < 0:
            raise NotAPickle(f"not a pickle: {_NAMES[data[where]]} at byte {where} has no "
                                f"end of line")
        pos = newline + 1
    return pos


def check_opcodes(data: bytes) -> None:
    """Walks the opcodes of the pickle `data` up to its STOP, keeping for every stack item
    and memo entry a bound on how deeply tuples nest in it (the deepest tuple among what the
    opcode took, plus one for a tuple); PickleRefused for tuples nested more than
    MAX_TUPLE_DEPTH deep, a memo index beyond the next free one, an unknown opcode, an
    argument past the end or no STOP. Where the unpickler would fail anyway (a stack
    underflow, a missing memo entry), the walk need not: it only bounds what can be built."""
    category, argument = _CATEGORY, _ARGUMENT
    stack: List[int] = []  # tuple depth bound of each item
    marks: List[int] = []  # stack lengths at each MARK
    memo: List[int] = []  # indices as a pickler writes them: 0, 1, 2, ...
    push, pop = stack.append, stack.pop
    pos, where, end = 0, 0, len(data)
    try:
        while True:
            where = pos
            code = data[pos]
            kind = category[code]
            if kind == _GET:
                width = argument[code]
                index = data[pos + 1] if width == 1 else int.from_bytes(
                    data[pos + 1:pos + 1 + width], "little")
                pos += 1 + width
                push(memo[index] if index < len(memo) else 0)
            elif kind == _PUSH:
                pos += 1 + argument[code]
                push(0)
            elif kind == _MEMOIZE:
                pos += 1
                memo.append(stack[-1])
            elif kind == _MARK:
                pos += 1
                marks.append(len(stack))
            elif kind == _TO_MARK:
                under, pushed, lines = argument[code]
                pos = _line_end(data, pos + 1, lines, where) if lines else pos + 1
                mark = marks.pop() - under
                if mark < 0:
                    raise IndexError
                depth = max(stack[mark:], default=0)
                del stack[mark:]
                if pushed:
                    push(depth)
            elif kind == _PUSH_COUNTED:
                width, signed = argument[code]
                length = int.from_bytes(data[pos + 1:pos + 1 + width], "little",
                                        signed=signed)
                if length < 0:
                    raise NotAPickle(f"not a pickle: a negative length at byte {where}")
                pos += 1 + width + length
                if pos > end:
                    raise IndexError
                push(0)
            elif kind == _PUT or kind == _PUT_LINE:
                if kind == _PUT:
                    width = argument[code]
                    index = int.from_bytes(data[pos + 1:pos + 1 + width], "little")
                    pos += 1 + width
                else:
                    pos = _line_end(data, pos + 1, 1, where)
                    index = _memo_index(data[where + 1:pos], where)
                if index == len(memo):
                    memo.append(stack[-1])
                elif index < len(memo):
                    memo[index] = stack[-1]
                else:
                    raise PickleRefused(f"not a pickle this reader takes: memo index {index} "
                                        f"at byte {where} skips past the next free one "
                                        f"({len(memo)})")
            elif kind == _POP_PUSH:
                popped, pushed, width = argument[code]
                pos += 1 + width
                if len(stack) < popped:
                    raise IndexError
                depth = max(stack[-popped:])
                del stack[-popped:]
                stack.extend([depth] * pushed)
            elif kind == _TUPLE or kind == _TUPLE_MARK:
                pos += 1
                start = marks.pop() if kind == _TUPLE_MARK else len(stack) - argument[code]
                if start < 0:
                    raise IndexError
                depth = max(stack[start:], default=0) + 1
                del stack[start:]
                if depth > MAX_TUPLE_DEPTH:
                    raise PickleRefused(f"the pickle nests tuples more than {MAX_TUPLE_DEPTH} "
                                        f"deep (byte {where})")
                push(depth)
            elif kind == _PUSH_LINES:
                pos = _line_end(data, pos + 1, argument[code], where)
                push(0)
            elif kind == _GET_LINE:
                pos = _line_end(data, pos + 1, 1, where)
                index = _memo_index(data[where + 1:pos], where)
                push(memo[index] if index < len(memo) else 0)
            elif kind == _SKIP:
                pos += 1 + argument[code]
            elif kind == _DUP:
                pos += 1
                push(stack[-1])
            elif kind == _POP:
                pos += 1
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    pop()
            elif kind == _STOP:
                pop()
                return
            else:
                raise NotAPickle(f"not a pickle: unknown opcode {code:#04x} at byte "
                                    f"{where}")
    except IndexError:  # past the end, or the stack or marks ran out
        if pos >= end:
            raise NotAPickle("the pickle is truncated (no STOP)") from None
        raise NotAPickle(f"not a pickle: {_NAMES[data[where]]} at byte {where} finds "
                            f"too little on the stack") from None


def load_builtins(data: bytes) -> Any:
    """The object the pickle `data` holds, which may be made of builtin containers and
    scalars only (see the module docstring). PickleRefused saying what is wrong otherwise;
    nothing is imported or called."""
    check_opcodes(data)
    try:
        return _BuiltinsOnly(io.BytesIO(data)).load()
    except PickleRefused:  # from find_class or persistent_load
        raise
    except RecursionError:
        raise NotAPickle("not a pickle this reader takes: nested too deeply") from None
    except MemoryError:
        raise NotAPickle("not a pickle this reader takes: out of memory") from None
    except Exception as e:  # the unpickler's own errors on malformed data
        raise NotAPickle(f"not a pickle this reader takes: {type(e).__name__}: "
                            f"{_short(str(e), 200)}") from None
