"""What the dynamic loader reads of a shared library, parsed from its ELF file (64-bit,
little-endian: x86-64 and aarch64), so that the tests need no binutils: the dynamic section
(SONAME, NEEDED, the SYMBOLIC flag), the dynamic symbols, and the symbols that dynamic
relocations name (a call through the PLT, which the loader may bind to another object)."""

from __future__ import annotations

import dataclasses
import struct

DT_NEEDED, DT_SONAME, DT_SYMBOLIC, DT_FLAGS = 1, 14, 16, 30
DF_SYMBOLIC = 0x2
SHT_RELA, SHT_DYNAMIC, SHT_DYNSYM = 4, 6, 11
SHN_UNDEF = 0


@dataclasses.dataclass
class Symbol:
    name: str
    defined: bool
    value: int


@dataclasses.dataclass
class DynamicInfo:
    soname: str | None
    needed: list
    symbolic: bool  # DT_SYMBOLIC or DF_SYMBOLIC: the object's own definitions bind first
    symbols: list  # the dynamic symbols, index order
    relocated: set  # names of the symbols the dynamic relocations name


def _sections(data: bytes):
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    return [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]


def _string(data: bytes, table_offset: int, index: int) -> str:
    start = table_offset + index
    return data[start:data.index(b"\0", start)].decode()


def read(path: str) -> DynamicInfo:
    with open(path, "rb") as f:
        data = f.read()
    sections = _sections(data)
    # Section header: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    dynsym = next(s for s in sections if s[1] == SHT_DYNSYM)
    dynstr = sections[dynsym[6]][4]
    symbols = []
    for i in range(dynsym[5] // 24):
        name, _info, _other, shndx, value, _size = struct.unpack_from(
            "<IBBHQQ", data, dynsym[4] + i * 24)
        symbols.append(Symbol(_string(data, dynstr, name), shndx != SHN_UNDEF, value))
    soname, needed, symbolic = None, [], False
    dynamic = next(s for s in sections if s[1] == SHT_DYNAMIC)
    strtab = sections[dynamic[6]][4]
    for i in range(dynamic[5] // 16):
        tag, val = struct.unpack_from("<qQ", data, dynamic[4] + i * 16)
        if tag == DT_NEEDED:
            needed.append(_string(data, strtab, val))
        elif tag == DT_SONAME:
            soname = _string(data, strtab, val)
        elif tag == DT_SYMBOLIC or (tag == DT_FLAGS and val & DF_SYMBOLIC):
            symbolic = True
    relocated = set()
    for s in sections:
        if s[1] == SHT_RELA and s[6] and sections[s[6]][1] == SHT_DYNSYM:
            for i in range(s[5] // 24):
                _offset, info, _addend = struct.unpack_from("<QQq", data, s[4] + i * 24)
                if info >> 32:
                    relocated.add(symbols[info >> 32].name)
    return DynamicInfo(soname, needed, symbolic, symbols, relocated)
