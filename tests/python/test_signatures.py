"""vmm_torch._signatures against torch_plugin/vmm_c.h: the one ctypes declaration of the C
interface declares every function of the header (and nothing else) with the same number of
arguments and compatible types; the struct and the enums match too.

The header is parsed with regular expressions over its C prototypes (the header keeps to one
declaration per statement, except struct members: "int64_t a, b;" and arrays "vmm_stat x[3]"
are read too; comments and preprocessor lines are dropped first). Needs no library:
_signatures imports ctypes only.
"""

import ctypes
import os
import re

import pytest

from vmm_torch import _signatures

HERE = os.path.dirname(os.path.abspath(__file__))
# In Bazel's runfiles and in a checkout alike: <root>/tests/python/ -> <root>/torch_plugin/.
HEADER = os.path.join(HERE, "..", "..", "torch_plugin", "vmm_c.h")

P = ctypes.POINTER

# C type (const dropped, pointers as "*") -> ctypes types accepted for it as an argument.
ARGUMENT_TYPES = {
    "int": {ctypes.c_int},
    "int32_t": {ctypes.c_int32},
    "int64_t": {ctypes.c_int64},
    "size_t": {ctypes.c_size_t},
    "double": {ctypes.c_double},
    "void*": {ctypes.c_void_p},
    "char*": {ctypes.c_char_p},
    "uint8_t*": {ctypes.c_char_p, P(ctypes.c_uint8)},  # bytes in
    "uint8_t**": {P(ctypes.c_void_p), P(ctypes.c_char_p), P(P(ctypes.c_uint8))},
    "int*": {P(ctypes.c_int)},
    "int64_t*": {P(ctypes.c_int64)},
    "uint64_t*": {P(ctypes.c_uint64)},
    "size_t*": {P(ctypes.c_size_t)},
    "uint64_t": {ctypes.c_uint64},
    "vmm_descriptor_fields*": {P(_signatures.DescriptorFields)},
    "vmm_send_stats*": {P(_signatures.SendStats)},
    "vmm_torch_stats*": {P(_signatures.TorchStats)},
    "vmm_snapshot_entries*": {P(_signatures.SnapshotEntries)},
    "vmm_snapshot_entries**": {P(P(_signatures.SnapshotEntries)), P(ctypes.c_void_p)},
    "vmm_block_entry*": {P(_signatures.BlockEntry)},
    "vmm_mapping_fn": {ctypes.c_void_p, _signatures.MappingFn},
}
# Results: a "char*" (not const) is a string to release, so it must stay a plain pointer.
RESULT_TYPES = {
    "void": {None},
    "int": {ctypes.c_int},
    "int64_t": {ctypes.c_int64},
    "uint64_t": {ctypes.c_uint64},
    "void*": {ctypes.c_void_p},
    "const char*": {ctypes.c_char_p},
    "char*": {ctypes.c_void_p},
}
# Struct members.
FIELD_TYPES = {
    "int32_t": {ctypes.c_int32},
    "uint64_t": {ctypes.c_uint64},
    "uint8_t*": {P(ctypes.c_uint8), ctypes.c_void_p},
    "uint64_t*": {P(ctypes.c_uint64), ctypes.c_void_p},
    "char*": {ctypes.c_void_p, P(ctypes.c_char)},  # with a length: may hold NULs
    "double": {ctypes.c_double},
    "int": {ctypes.c_int},
    "int64_t": {ctypes.c_int64},
    "size_t": {ctypes.c_size_t},
    "vmm_stat": {_signatures.Stat},
    "vmm_stat[3]": {_signatures.Stat * 3},
    "uint64_t[2]": {ctypes.c_uint64 * 2},
    "vmm_block_entry*": {P(_signatures.BlockEntry)},
    "vmm_segment_entry*": {P(_signatures.SegmentEntry)},
}


def _read_header():
    with open(HEADER) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    defines = dict(re.findall(r"^\s*#\s*define\s+(\w+)\s+(\d+)\s*$", text, flags=re.M))
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    text = re.sub(r'extern\s+"C"\s*\{', " ", text)
    return text, {k: int(v) for k, v in defines.items()}


def _normalise(c_type):
    """"const uint8_t* const*" -> "uint8_t**"; "char *" -> "char*"."""
    c_type = re.sub(r"\bconst\b", " ", c_type)
    c_type = re.sub(r"\s*\*\s*", "*", c_type)
    return " ".join(c_type.split())


def _split_declaration(declaration):
    """("type", "name") of "const uint8_t* const* handles" or of "int x"."""
    match = re.fullmatch(r"(.*?[\s*])(\w+)", declaration.strip(), flags=re.S)
    assert match, declaration
    return match.group(1), match.group(2)


def _struct_members(declaration):
    """[(member, type)] of one struct member declaration: "int64_t a, b" gives two members of
    type "int64_t", "vmm_stat x[3], y[3]" two of type "vmm_stat[3]"."""
    first, *more = declaration.split(",")
    match = re.fullmatch(r"(.*?[\s*])(\w+)\s*(\[\s*\w+\s*\])?", first.strip(), flags=re.S)
    assert match, declaration
    base = _normalise(match.group(1))
    members = [(match.group(2), base + (match.group(3) or "").replace(" ", ""))]
    for declarator in more:
        match = re.fullmatch(r"(\w+)\s*(\[\s*\w+\s*\])?", declarator.strip())
        assert match, declaration
        members.append((match.group(1), base + (match.group(2) or "").replace(" ", "")))
    return members


def parse_header():
    """(functions, structs, enums, defines) of vmm_c.h: functions {name: (result type,
    [argument types])}, structs {name: [(member, type)]}, enums {name: {constant: value}}."""
    text, defines = _read_header()
    structs, enums = {}, {}
    for name, body in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\w+\s*;", text,
                                 flags=re.S):
        members = []
        for declaration in body.split(";"):
            if declaration.strip():
                members.extend(_struct_members(declaration))
        structs[name] = members
    for name, body in re.findall(r"\benum\s+(\w+)\s*\{(.*?)\}\s*;", text, flags=re.S):
        values = {}
        for item in body.split(","):
            if item.strip():
                constant, value = (s.strip() for s in item.split("="))
                values[constant] = int(value)
        enums[name] = values
    text = re.sub(r"typedef\s+struct\s+\w+\s*\{.*?\}\s*\w+\s*;", " ", text, flags=re.S)
    text = re.sub(r"\benum\s+\w+\s*\{.*?\}\s*;", " ", text, flags=re.S)
    # Function pointer types ("typedef void (*vmm_x_fn)(...);"): argument types, not prototypes.
    text = re.sub(r"typedef\s+[^;]*?\(\s*\*\s*\w+\s*\)\s*\([^;]*\)\s*;", " ", text)
    functions = {}
    for statement in text.split(";"):
        statement = " ".join(statement.split())
        if not statement or statement == "}":
            continue
        match = re.fullmatch(r"(.*?[\s*])(vmm_\w+)\s*\((.*)\)", statement)
        assert match, f"not a prototype: {statement!r}"
        result, name, params = match.groups()
        params = params.strip()
        arguments = []
        if params != "void":
            for param in params.split(","):
                arguments.append(_normalise(_split_declaration(param)[0]))
        assert name not in functions, f"{name} declared twice"
        functions[name] = (" ".join(re.sub(r"\s*\*\s*", "*", result).split()), arguments)
    return functions, structs, enums, defines


FUNCTIONS, STRUCTS, ENUMS, DEFINES = parse_header()


def test_the_header_was_parsed():
    assert len(FUNCTIONS) >= 30, sorted(FUNCTIONS)
    assert FUNCTIONS["vmm_import"] == ("int64_t", ["uint8_t*", "size_t", "int", "int", "int"])
    assert FUNCTIONS["vmm_last_error"] == ("const char*", [])
    assert FUNCTIONS["vmm_descriptor_from_handles"][1][1] == "uint8_t**"
    assert "vmm_descriptor_fields" in STRUCTS and "vmm_backend" in ENUMS


def test_the_same_functions():
    declared = set(_signatures.SIGNATURES)
    in_header = set(FUNCTIONS)
    assert not in_header - declared, f"in vmm_c.h, not in _signatures: {in_header - declared}"
    assert not declared - in_header, f"in _signatures, not in vmm_c.h: {declared - in_header}"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_signature_matches(name):
    c_result, c_arguments = FUNCTIONS[name]
    restype, argtypes = _signatures.SIGNATURES[name]
    assert len(argtypes) == len(c_arguments), (
        f"{name}: {len(c_arguments)} arguments in vmm_c.h, {len(argtypes)} declared")
    assert c_result in RESULT_TYPES, f"{name}: no mapping for result type {c_result!r}"
    assert restype in RESULT_TYPES[c_result], (
        f"{name}: result {c_result} declared as {restype}")
    for i, (c_type, declared) in enumerate(zip(c_arguments, argtypes)):
        assert c_type in ARGUMENT_TYPES, f"{name}: no mapping for argument type {c_type!r}"
        assert declared in ARGUMENT_TYPES[c_type], (
            f"{name}: argument {i} is {c_type} in vmm_c.h, declared as {declared}")


def test_struct_fields_match():
    assert set(STRUCTS) == set(_signatures.STRUCTS)
    for name, members in STRUCTS.items():
        declared = _signatures.STRUCTS[name]._fields_
        assert [m for m, _ in members] == [f[0] for f in declared], name
        for (member, c_type), (_, ctype) in zip(members, declared):
            assert c_type in FIELD_TYPES, f"{name}.{member}: no mapping for {c_type!r}"
            assert ctype in FIELD_TYPES[c_type], f"{name}.{member}: {c_type} as {ctype}"


def test_struct_layout_is_the_natural_one():
    # No packing pragmas in the header: ctypes' default alignment is the C compiler's.
    fields = _signatures.DescriptorFields
    assert ctypes.sizeof(fields) == 4 + 4 + 8 * 3 + 8 * 3 + 8
    assert fields.handles.offset == 32


def test_the_statistics_and_snapshot_structs_have_the_c_layout():
    # vmm_c.cc asserts the same sizes of the C structs.
    assert ctypes.sizeof(_signatures.Stat) == 32
    assert ctypes.sizeof(_signatures.TorchStats) == (9 * 3 + 2) * 32 + 6 * 8
    assert _signatures.TorchStats.num_alloc_retries.offset == 9 * 3 * 32
    assert ctypes.sizeof(_signatures.BlockEntry) == 4 * 8 + 8  # the int padded to 8
    assert _signatures.SegmentEntry.pool.offset == 8
    assert ctypes.sizeof(_signatures.SegmentEntry) == 8 * 8 + 8 + 8 + 8 + 16
    assert _signatures.SegmentEntry.mempool_id.offset == 8 * 8 + 8 + 8 + 8
    assert STRUCTS["vmm_stat"] == [("current", "int64_t"), ("peak", "int64_t"),
                                   ("allocated", "int64_t"), ("freed", "int64_t")]
    assert ("requested_bytes", "vmm_stat[3]") in STRUCTS["vmm_torch_stats"]


def test_enums_and_defines_match():
    assert ENUMS == _signatures.ENUMS
    for name, value in _signatures.DEFINES.items():
        assert DEFINES.get(name) == value, name


def test_the_library_exports_every_function():
    vmm_torch = pytest.importorskip("vmm_torch")
    libs = vmm_torch.load()
    for name in _signatures.SIGNATURES:
        assert getattr(libs.vmm, name).argtypes is not None, name
