"""Rows the validator's store could not write because its disk was full, kept where a killed process finds them.

While the disk is full the store keeps appended rows in memory (neurons/validator_app/store.py). A process killed
then (SIGKILL, an OOM kill, a power-off of the container) would lose them; so each batch is also appended to a
spill file on a RAM-backed file system that does not share the database's disk (`/dev/shm` where there is one,
or the directory named by `K3_VALIDATOR_SPILL_DIR`). It survives the process, not a reboot of the host.

It is opened without following links (a link planted in the shared directory would otherwise have the rows
appended to the file it names). The file is one JSON object per line: first `{"format": FORMAT, "id": ..., "db": ...}`, then one batch per line
(`{"table", "columns", "rows"}`). It is named after the database's absolute path, readable by its owner only,
and is replayed only when that owner is this process's user. The store writes the kept rows and, in the same
transaction, the spill's id in its `meta` table; then it deletes the file. A file whose id the database already
holds was written before a kill and is deleted unread, so no row is written twice. A line cut short by a kill is
the last one, and is dropped (its rows never left the process's memory as a whole).

Only inserts into the append-only tables are replayed, with columns those tables have: the file names data,
never SQL.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from stat import S_ISREG
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger("k3.validator.store")
FORMAT = "k3-validator-spill/1"
SPILL_DIR_ENV = "K3_VALIDATOR_SPILL_DIR"
RAM_DIR = "/dev/shm"  # Linux's RAM-backed file system, on no disk
SCALARS = (str, int, float, type(None))


class SpillError(Exception):
    """A spill file that cannot be replayed (someone else's, or not one of ours): the message says which."""


class RowSpill:
    """The spill file of one database (module doc); `path` None where no RAM-backed directory exists."""

    def __init__(self, db: Path, directory: Optional[Path] = None):
        self.db = Path(db).resolve()
        directory = directory if directory is not None else spill_directory()
        name = f"k3-validator-{hashlib.sha256(str(self.db).encode()).hexdigest()[:16]}.spill"
        self.path: Optional[Path] = directory / name if directory is not None else None
        self.id: Optional[str] = None  # of the file this process writes; None until its first batch

    def add(self, table: str, columns: Sequence[str], rows: Sequence[Sequence]) -> bool:
        """Append one batch; False (and a warning) where it cannot be kept there."""
        if self.path is None:
            return False
        try:
            lines = []
            if self.id is None:
                self.id = uuid.uuid4().hex
                lines.append(json.dumps({"format": FORMAT, "id": self.id, "db": str(self.db)}))
            lines.append(json.dumps({"table": table, "columns": list(columns), "rows": [list(r) for r in rows]}))
            # never through a link someone planted in a shared directory (it would append to the file it names)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            try:
                if os.fstat(fd).st_uid != os.getuid():
                    raise SpillError(f"{self.path} belongs to another user")
                os.write(fd, ("\n".join(lines) + "\n").encode())
            finally:
                os.close(fd)
            return True
        except (OSError, TypeError, ValueError, SpillError) as error:
            log.warning("cannot keep rows the full disk refused in %s (%s): a kill before the disk has room loses "
                        "them", self.path, error)
            return False

    def read(self, table_columns: dict[str, set[str]]) -> tuple[Optional[str], list[tuple[str, list[str], list]]]:
        """The id and batches of a spill left by an earlier process; (None, []) when there is none. Batches are
        checked against `table_columns` (the append-only tables and their columns); SpillError otherwise."""
        if self.path is None or not os.path.lexists(self.path):
            return None, []
        stat = self.path.lstat()
        if not S_ISREG(stat.st_mode):
            raise SpillError(f"{self.path} is not a plain file (a link, or something else); move it aside")
        if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
            raise SpillError(f"{self.path} is not this user's alone (owner uid {stat.st_uid}, mode "
                             f"{stat.st_mode & 0o777:o}); move it aside")
        lines = self.path.read_text(errors="replace").split("\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("db") != str(self.db):
            raise SpillError(f"{self.path} is not a spill of {self.db}; move it aside")
        batches = []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the last line, without its newline: cut short by a kill
                    break
                raise SpillError(f"{self.path} line {number} is not JSON; move it aside") from None
            batches.append(_checked(batch, table_columns, f"{self.path} line {number}"))
        return str(header["id"]), batches

    def discard(self) -> None:
        """Delete the file (its rows are in the database); the next spill starts a new one."""
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("cannot delete the spill %s (%s)", self.path, error)
        self.id = None


def spill_directory() -> Optional[Path]:
    named = os.environ.get(SPILL_DIR_ENV, "")
    if named:
        return Path(named)
    ram = Path(RAM_DIR)
    return ram if ram.is_dir() and os.access(ram, os.W_OK) else None


def _checked(batch, table_columns: dict[str, set[str]], where: str) -> tuple[str, list[str], list]:
    if not isinstance(batch, dict) or set(batch) != {"table", "columns", "rows"}:
        raise SpillError(f"{where}: not a batch of rows; move the file aside")
    table, columns, rows = batch["table"], batch["columns"], batch["rows"]
    if table not in table_columns:
        raise SpillError(f"{where}: {table!r} is not an append-only table; move the file aside")
    if not isinstance(columns, list) or not columns or not set(columns) <= table_columns[table]:
        raise SpillError(f"{where}: columns {columns!r} are not all columns of {table}; move the file aside")
    if not isinstance(rows, list) or any(not isinstance(r, list) or len(r) != len(columns)
                                         or not all(isinstance(v, SCALARS) for v in r) for r in rows):
        raise SpillError(f"{where}: rows that do not fit the columns; move the file aside")
    return table, columns, [tuple(r) for r in rows]
