"""A run of consecutive ranks of a mesh line as a line of its own: where partition
``documents`` cuts a document over a group of ranks (``schedules.assign.plan``), the cut
documents' schedule runs over that group only, its transfers among the group's ranks.

    line of 8 ranks, groups of 4:   [0 1 2 3] [4 5 6 7]
    rank 5 in its group:            index 1 of 4; its ring: 4 -> 5 -> 6 -> 7 -> 4
"""

from __future__ import annotations


class SubLine:
    """The mesh of a schedule over ranks [first, first + size) of ``mesh``'s line along
    ``dim``: that dim's size, this rank's coordinate and the line's ranks are the group's;
    everything else is ``mesh``'s."""

    def __init__(self, mesh, dim: str, first: int, size: int):
        self._mesh, self._dim, self._first, self._size = mesh, dim, first, size

    def size(self, name: str | None = None) -> int:
        return self._size if name == self._dim else self._mesh.size(name)

    def coordinate(self, name: str) -> int:
        where = self._mesh.coordinate(name)
        return where - self._first if name == self._dim else where

    def ranks(self, name: str) -> list[int]:
        line = self._mesh.ranks(name)
        return line[self._first:self._first + self._size] if name == self._dim else line

    def __getattr__(self, name):
        return getattr(self._mesh, name)

    def __repr__(self) -> str:
        return (f"ranks {self._first}-{self._first + self._size - 1} of {self._dim} of "
                f"{self._mesh!r}")
