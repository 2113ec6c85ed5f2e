"""Everything a validator learns, in one SQLite file, so that a restart loses nothing.

Tables (schema version `SCHEMA_VERSION`, kept in `meta` and mirrored in SQLite's `PRAGMA user_version`):
- `measurements`: one row per request (scoring.metrics COLUMNS), written as soon as the request is
  measured, with the round it belongs to, where it came from ("validator" rounds, "organic" gateway
  traffic) and the validator CPU seconds its tier-0 checks took;
- `failures`: every failed check or failed call, with its reason;
- `audits`: every tier-1 audit and tier-2 canary verdict;
- `scores`: each round's scores per uid (components, gate, reasons) and the EMA after it;
- `ema`: the EMA of S per uid, with the hotkey it belongs to;
- `miners`: the last seen hotkey, coldkey, endpoint and capabilities of each uid;
- `weights` and `weight_attempts`: the last weights set on chain, and every attempt to set them;
- `canaries`: the canary pool the validator computed itself, and which canaries were used;
- `stage_miners`, `stage_checks`: swarm stage miners seen, and every stage challenge, route audit, bisection
  verdict, decoy sighting and credited route work, with its reason (`blame = 1`: the stage is zeroed;
  neurons/validator_app/stage_rounds.py), and every opening of a whole-model miner's state commitment (kind
  `state_opening`, scoring.openings); each check with what it cost the validator (CPU and wall seconds, weight
  bytes read from disk, peak resident weights and process memory, its compute and the checked miner's);
- `meta`: schema version, round counters, when weights were last set;
- `schema_migrations`: each migration applied to this file, when, and by which release.

Upgrades: the file records the schema version that wrote it. Opening it for writing applies the
migrations in `MIGRATIONS` newer than that version, in order, each in its own transaction, after
copying the file as it was to `<db>.schema-v<N>.bak`. A new database is made the same way (version 1,
then every migration), so a fresh file and an upgraded one are the same. A file written by a newer
release is refused (no downgrades). To change the schema, append a `Migration` (never edit
`_SCHEMA_V1` or a released migration); `SCHEMA_VERSION` follows.

WAL mode, so the status command and the organic gateway can read (and the gateway write organic
measurements) while the validator runs. Each write is its own short transaction.

A full disk: a write transaction that fails with SQLite's "database or disk is full" rolls back. Rows that are
only ever appended (measurements, failures, audits, stage checks) are then kept in memory, in order, and written
with the next append or `write_deferred()` (the validator calls it every DEFERRED_RETRY_S) once the disk has room
(`deferred_rows`); up to MAX_DEFERRED_ROWS, beyond which the error goes to the caller. They are also kept in a
spill file off the disk (neurons/validator_app/spill.py), which the next process to open the database writes in,
so a validator killed while its disk is full loses none of them. Other writes (a round's scores, weights,
miners) raise it and are made again later.
Test-only: while the file named by the environment variable `K3_TEST_STORE_FULL_FILE` exists, every transaction
that changed something fails at COMMIT exactly so (the local testnet's soak fills the validator's disk this way,
docs/localnet.md).
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from inference.version import __version__
from scoring.metrics import COLUMNS, Measurement, MeasurementWindow
from scoring.rewards import EmaEntry, MinerScore

from .spill import RowSpill, SpillError

log = logging.getLogger("k3.validator.store")
SOURCES = ("validator", "organic")
STORE_FULL_FILE_ENV = "K3_TEST_STORE_FULL_FILE"  # test-only (module doc)
DISK_FULL = "database or disk is full"  # SQLite's message for SQLITE_FULL
MAX_DEFERRED_ROWS = 100_000  # appended rows kept in memory while the disk is full
DEFERRED_RETRY_S = 1.0  # how often the validator tries again to write them
APPEND_ONLY_TABLES = ("measurements", "failures", "audits", "stage_checks")
WORK_KINDS = ("validator_work", "gateway_work", "route_work")  # stage_checks rows that credit layer-tokens
OWN_WORK_KINDS = ("validator_work", "gateway_work")  # of sessions the validator's own driver spread by load

# Measurement columns as SQLite types (the dataclass holds only scalars).
_MEASUREMENT_TYPES = {
    "uid": "INTEGER NOT NULL", "hotkey": "TEXT NOT NULL", "at": "REAL NOT NULL", "kind": "TEXT NOT NULL",
    "request_id": "TEXT NOT NULL", "outcome": "TEXT NOT NULL", "tier0_ok": "INTEGER", "prompt_tokens": "INTEGER",
    "completion_tokens": "INTEGER", "ttft_s": "REAL", "total_s": "REAL", "decode_tps": "REAL",
    "ttft_per_1k_s": "REAL", "long_context_success": "INTEGER", "audits": "INTEGER", "audit_failures": "INTEGER",
    "quality": "REAL", "hard_failure": "INTEGER", "failures": "TEXT", "burst_id": "TEXT", "burst_tokens": "INTEGER",
    "burst_wall_s": "REAL", "probe_answer": "INTEGER", "committed": "INTEGER",
}
_SCHEMA_V1_COLUMNS = tuple(c for c in COLUMNS if c not in ("probe_answer", "committed"))  # added by migrations 4, 6
if set(_MEASUREMENT_TYPES) != set(COLUMNS):  # scoring.metrics changed its columns: the schema must follow
    raise ImportError(f"validator_store knows measurement columns {sorted(_MEASUREMENT_TYPES)}, "
                      f"scoring.metrics has {sorted(COLUMNS)}")

_SCORE_FIELDS = ("coldkey", "requests", "answered", "verified", "decode_tps", "ttft_per_1k_s", "burst_tps",
                 "long_context_share", "D", "F", "C", "L", "perf", "quality", "reliability", "gate", "score",
                 "audits", "audit_failures", "hard_failures", "zeroed")

# Schema version 1 as the first release wrote it. Never edit: a change is a new Migration below.
_SCHEMA_V1 = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    round INTEGER NOT NULL,
    source TEXT NOT NULL,
    tier0_cpu_s REAL,
    {", ".join(f'"{c}" {_MEASUREMENT_TYPES[c]}' for c in _SCHEMA_V1_COLUMNS)}
);
CREATE INDEX IF NOT EXISTS measurements_uid ON measurements (uid, at);
CREATE INDEX IF NOT EXISTS measurements_at ON measurements (at);
CREATE TABLE IF NOT EXISTS failures (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL, round INTEGER NOT NULL, uid INTEGER NOT NULL, hotkey TEXT NOT NULL,
    request_id TEXT, kind TEXT, check_name TEXT NOT NULL, reason TEXT NOT NULL, hard INTEGER NOT NULL,
    source TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS failures_uid ON failures (uid, at);
CREATE TABLE IF NOT EXISTS audits (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL, round INTEGER NOT NULL, uid INTEGER NOT NULL, hotkey TEXT NOT NULL,
    request_id TEXT NOT NULL, kind TEXT NOT NULL, tier INTEGER NOT NULL, reference TEXT NOT NULL,
    passed INTEGER, quality REAL, mean_prob_diff REAL, positions INTEGER, greedy_mismatches INTEGER,
    outside_top_k INTEGER, disagreement INTEGER, error TEXT, failures TEXT, cpu_s REAL, wall_s REAL
);
CREATE INDEX IF NOT EXISTS audits_uid ON audits (uid, at);
CREATE TABLE IF NOT EXISTS scores (
    round INTEGER NOT NULL, uid INTEGER NOT NULL, hotkey TEXT NOT NULL, at REAL NOT NULL,
    {", ".join(f'"{f}" REAL' for f in _SCORE_FIELDS if f != "coldkey")}, coldkey TEXT, reasons TEXT,
    ema REAL,
    PRIMARY KEY (round, uid)
);
CREATE TABLE IF NOT EXISTS ema (
    uid INTEGER PRIMARY KEY, hotkey TEXT NOT NULL, value REAL NOT NULL, round INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS miners (
    uid INTEGER PRIMARY KEY, hotkey TEXT NOT NULL, coldkey TEXT NOT NULL, url TEXT,
    capabilities TEXT, capabilities_at REAL, last_round INTEGER, seen_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS weights (uid INTEGER PRIMARY KEY, hotkey TEXT, weight REAL NOT NULL);
CREATE TABLE IF NOT EXISTS weight_attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, block INTEGER, ok INTEGER NOT NULL,
    error TEXT, weights TEXT
);
CREATE TABLE IF NOT EXISTS canaries (id TEXT PRIMARY KEY, body TEXT NOT NULL, used INTEGER NOT NULL DEFAULT 0);
"""


@dataclass
class StageTotals:
    """One hotkey's stage_checks added up (ValidatorStore.stage_totals): layer-tokens per work kind, rows per kind."""
    tokens: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Migration:
    """What turns a database of schema `version - 1` into one of schema `version`."""
    version: int
    summary: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(2, "log of applied migrations; failures indexed by check (failure counts per check)", (
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, summary TEXT NOT NULL, "
        "applied_at REAL NOT NULL, code_version TEXT NOT NULL)",
        "CREATE INDEX failures_check ON failures (check_name, at)",
    )),
    Migration(3, "swarm stage miners and their checks (challenges, route audits, bisection, blame)", (
        "CREATE TABLE stage_miners (uid INTEGER PRIMARY KEY, hotkey TEXT NOT NULL, coldkey TEXT, url TEXT, "
        "layers TEXT NOT NULL, fingerprint TEXT, step_ms REAL, seen_at REAL NOT NULL)",
        "CREATE TABLE stage_checks (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, round INTEGER NOT NULL, "
        "uid INTEGER, hotkey TEXT NOT NULL, layers TEXT, kind TEXT NOT NULL, passed INTEGER NOT NULL, "
        "blame INTEGER NOT NULL DEFAULT 0, reason TEXT, tokens INTEGER, steps INTEGER, median_rel_l2 REAL, "
        "bad_fraction REAL, step_ms REAL, cpu_s REAL, wall_s REAL, commitment TEXT, seed TEXT, nonce TEXT)",
        "CREATE INDEX stage_checks_hotkey ON stage_checks (hotkey, at)",
    )),
    Migration(4, "answer probes judged by their miss rate: measurements.probe_answer", (
        "ALTER TABLE measurements ADD COLUMN probe_answer INTEGER",
    )),
    Migration(5, "stage sessions checked after the fact from the stages' ledgers, judged against the honest envelope "
                 "of their numerics; route work credited per request the validator sent", (
        *(f"ALTER TABLE stage_checks ADD COLUMN {c}" for c in (
            "numerics TEXT", "bad INTEGER", "q90_rel_l2 REAL", "worst_rel_l2 REAL", "outside TEXT", "route_id TEXT",
            "session TEXT", "request_id TEXT", "origin TEXT", "bytes_read INTEGER")),
        "CREATE INDEX stage_checks_request ON stage_checks (request_id)",
        "CREATE INDEX measurements_request ON measurements (request_id)",
    )),
    Migration(6, "validator cost per check (weight bytes read from disk, peak resident weights and process memory, "
                 "the check's compute and the checked miner's for the same tokens); whether an answer carried a "
                 "state commitment", (
        *(f"ALTER TABLE stage_checks ADD COLUMN {c}" for c in (
            "weights_read INTEGER", "peak_resident INTEGER", "peak_rss INTEGER", "check_flops REAL",
            "checked_flops REAL")),
        "ALTER TABLE measurements ADD COLUMN committed INTEGER",
    )),
)
SCHEMA_VERSION = MIGRATIONS[-1].version if MIGRATIONS else 1
if [m.version for m in MIGRATIONS] != list(range(2, SCHEMA_VERSION + 1)):
    raise ImportError("validator store migrations must be numbered 2, 3, ... in order")


class ValidatorStoreError(RuntimeError):
    """The database cannot be used (wrong schema, not a validator database, unreadable)."""


@dataclass(frozen=True)
class StoredMiner:
    uid: int
    hotkey: str
    coldkey: str
    url: Optional[str]
    capabilities: Optional[dict]
    capabilities_at: Optional[float]
    last_round: Optional[int]
    seen_at: float


@dataclass(frozen=True)
class LastWeights:
    weights: dict[int, float]
    hotkeys: dict[int, str]
    set_at: Optional[float]
    block: Optional[int]
    version_key: Optional[int]


class ValidatorStore:
    """The validator's SQLite database. One connection per process (the loop runs on one thread)."""

    def __init__(self, path: str | os.PathLike, readonly: bool = False, busy_timeout_s: float = 10.0):
        self.path = Path(path).expanduser()
        self.readonly = readonly
        self._full_file = os.environ.get(STORE_FULL_FILE_ENV, "")
        # appends not yet written (disk full), oldest first: (table, columns, rows)
        self._deferred: list[tuple[str, Sequence[str], list[tuple]]] = []
        self._spill = RowSpill(self.path)
        if readonly and not self.path.exists():
            raise ValidatorStoreError(f"no validator database at {self.path}: run the validator first "
                                      f"(python neurons/validator.py run --db {self.path} ...)")
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if readonly:
                self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=busy_timeout_s,
                                             isolation_level=None)
            else:
                self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None)
        except sqlite3.Error as error:
            raise ValidatorStoreError(f"cannot open the validator database {self.path}: {error}") from None
        self._conn.row_factory = sqlite3.Row
        try:
            if not readonly:
                self._conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL survives a process crash in WAL mode (only a power cut can lose the last commit).
                self._conn.execute("PRAGMA synchronous=NORMAL")
                self._create()
            self._check_schema()
            if not readonly:
                self._replay_spill()
        except sqlite3.DatabaseError as error:
            self._conn.close()
            raise ValidatorStoreError(f"{self.path} is not a usable validator database: {error}") from None
        except BaseException:
            self._conn.close()
            raise

    def _create(self) -> None:
        """Make a new database, or bring an older one up to SCHEMA_VERSION."""
        with self._transaction() as conn:
            version = _stored_version(conn)
            if version is None:
                if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table'").fetchone():
                    return  # someone else's tables: _check_schema explains
                for statement in _SCHEMA_V1.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                self._set_meta(conn, "schema_version", 1)
                self._set_meta(conn, "created_at", repr(time.time()))
                conn.execute("PRAGMA user_version = 1")
                version = 0  # new: nothing to keep a copy of
        if version is None or version >= SCHEMA_VERSION:
            return  # current, or newer than this code (_check_schema explains)
        if version > 0:
            backup = self.path.with_name(f"{self.path.name}.schema-v{version}.bak")
            if not backup.exists():
                copy = sqlite3.connect(backup)
                try:
                    self._conn.backup(copy)
                finally:
                    copy.close()
                log.info("validator database %s has schema %d; a copy as it was is in %s", self.path, version, backup)
        for migration in MIGRATIONS:
            with self._transaction() as conn:
                if _stored_version(conn) >= migration.version:  # another process got there first
                    continue
                for statement in migration.statements:
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_migrations (version, summary, applied_at, code_version) "
                             "VALUES (?, ?, ?, ?)", (migration.version, migration.summary, time.time(), __version__))
                self._set_meta(conn, "schema_version", migration.version)
                conn.execute(f"PRAGMA user_version = {int(migration.version)}")
            if version > 0:
                log.info("validator database %s: migrated to schema %d (%s)", self.path, migration.version,
                         migration.summary)

    def _check_schema(self) -> None:
        version = _stored_version(self._conn)
        if version is None:
            raise ValidatorStoreError(f"{self.path} is not a validator database (no schema version)")
        if version > SCHEMA_VERSION:
            raise ValidatorStoreError(
                f"{self.path} has validator schema {version}, written by a newer release; this code reads up to "
                f"{SCHEMA_VERSION}. Run the newer release (downgrades are not supported), or move the file aside "
                "(the validator then starts a fresh history)")
        if version < SCHEMA_VERSION:
            raise ValidatorStoreError(
                f"{self.path} has validator schema {version}; this code reads {SCHEMA_VERSION}. Start the validator "
                "once (`run` upgrades the file in place and keeps a copy of the old one) before reading it")

    def schema_history(self) -> list[sqlite3.Row]:
        """The migrations applied to this file, oldest first."""
        return self._conn.execute("SELECT * FROM schema_migrations ORDER BY version").fetchall()

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ValidatorStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    class _Transaction:
        def __init__(self, conn: sqlite3.Connection, full_file: str = ""):
            self.conn = conn
            self.full_file = full_file
            self.changes = 0

        def __enter__(self):
            self.conn.execute("BEGIN IMMEDIATE")
            self.changes = self.conn.total_changes
            return self.conn

        def __exit__(self, exc_type, exc, tb):
            if exc_type is None and self.full_file and os.path.exists(self.full_file) \
                    and self.conn.total_changes != self.changes:
                self.conn.execute("ROLLBACK")
                raise sqlite3.OperationalError(DISK_FULL)
            self.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")
            return False

    def _transaction(self) -> "_Transaction":
        return self._Transaction(self._conn, self._full_file)

    def _append(self, table: str, columns: Sequence[str], rows: list[tuple]) -> None:
        """Insert rows of an append-only table, after any kept back by a full disk (module doc)."""
        if not rows:
            return
        self._deferred.append((table, columns, rows))
        try:
            self._write_kept()
        except sqlite3.OperationalError as error:
            kept = self.deferred_rows
            if DISK_FULL not in str(error) or kept > MAX_DEFERRED_ROWS:
                self._deferred.pop()
                raise
            if len(self._deferred) == 1:
                log.warning("validator database %s: the disk is full; keeping new rows in memory until it has room",
                            self.path)
            self._spill.add(table, columns, rows)

    def write_deferred(self) -> int:
        """Write the rows a full disk kept back, if it has room now; the number still kept back."""
        if self._deferred:
            try:
                self._write_kept()
            except sqlite3.OperationalError as error:
                if DISK_FULL not in str(error):
                    raise
        return self.deferred_rows

    def _write_kept(self) -> None:
        """Insert every kept batch in one transaction (with the id of their spill, if any), then forget them."""
        with self._transaction() as conn:
            for table, columns, values in self._deferred:
                conn.executemany(_insert_sql(table, columns), values)
            if self._spill.id is not None:
                self._set_meta(conn, "spill_written", self._spill.id)
        if len(self._deferred) > 1 or self._spill.id is not None:
            log.info("validator database %s: wrote %d rows kept back while the disk was full", self.path,
                     self.deferred_rows)
        if self._spill.id is not None:
            self._spill.discard()
        self._deferred.clear()

    def _replay_spill(self) -> None:
        """Take up the rows an earlier process kept back in its spill and could not write (spill.py)."""
        columns = {t: {r["name"] for r in self._conn.execute(f"PRAGMA table_info({t})")} for t in APPEND_ONLY_TABLES}
        try:
            spill_id, batches = self._spill.read(columns)
        except (SpillError, OSError) as error:
            log.warning("validator database %s: a spill of rows kept back by a full disk cannot be read: %s",
                        self.path, error)
            return
        if spill_id is None:
            return
        if self._meta("spill_written") == spill_id:  # written before a kill took the process, not yet deleted
            self._spill.discard()
            return
        self._spill.id = spill_id
        self._deferred = list(batches)
        if not batches:
            self._spill.discard()
            return
        log.info("validator database %s: %d rows an earlier process kept back while the disk was full", self.path,
                 self.deferred_rows)
        self.write_deferred()

    @property
    def deferred_rows(self) -> int:
        """Appended rows kept in memory because the disk was full (written with the next append)."""
        return sum(len(values) for _, _, values in self._deferred)

    # ------------------------------------------------------------ meta
    def _meta(self, key: str) -> Optional[str]:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def _set_meta(self, conn: sqlite3.Connection, key: str, value) -> None:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(value)))

    @property
    def round(self) -> int:
        """The last round started (0 before the first)."""
        return int(self._meta("round") or 0)

    @property
    def completed_round(self) -> int:
        """The last round whose scores and EMA were saved."""
        return int(self._meta("completed_round") or 0)

    def begin_round(self) -> int:
        """Number and record the next round; a round cut short by a crash keeps its number."""
        with self._transaction() as conn:
            number = int((conn.execute("SELECT value FROM meta WHERE key = 'round'").fetchone() or [0])[0]) + 1
            self._set_meta(conn, "round", number)
            self._set_meta(conn, "round_started_at", repr(time.time()))
        return number

    # ------------------------------------------------------------ measurements
    def add_measurements(self, rows: Sequence[tuple[Measurement, Optional[float]]], round_number: int,
                         source: str = "validator") -> None:
        """(measurement, tier-0 CPU seconds) pairs, committed at once."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        self._append("measurements", ("round", "source", "tier0_cpu_s", *COLUMNS),
                     [(round_number, source, cpu_s, *_measurement_values(m)) for m, cpu_s in rows])

    def load_window(self, window_s: float, keep_s: Optional[float] = None,
                    now: Optional[float] = None) -> tuple[MeasurementWindow, int]:
        """The measurement window as it was (rows younger than keep_s), and the highest row id read."""
        now = time.time() if now is None else now
        keep = max(window_s, keep_s or 0.0)
        columns = ", ".join(f'"{c}"' for c in COLUMNS)
        rows = self._conn.execute(f"SELECT {columns} FROM measurements WHERE at >= ? ORDER BY id",
                                  (now - keep,)).fetchall()
        last = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM measurements").fetchone()[0]
        return MeasurementWindow.from_rows(rows, window_s, keep_s), int(last)

    def measurements_after(self, after_id: int, source: str) -> tuple[list[Measurement], int]:
        """Rows of `source` written after row `after_id` (by another process, e.g. the gateway), and the
        highest row id now present."""
        columns = ", ".join(f'"{c}"' for c in COLUMNS)
        rows = self._conn.execute(f"SELECT {columns} FROM measurements WHERE id > ? AND source = ? ORDER BY id",
                                  (after_id, source)).fetchall()
        last = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM measurements").fetchone()[0]
        return list(MeasurementWindow.from_rows(rows).rows()), int(last)

    def measurement_count(self, uid: Optional[int] = None) -> int:
        if uid is None:
            return int(self._conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0])
        return int(self._conn.execute("SELECT COUNT(*) FROM measurements WHERE uid = ?", (uid,)).fetchone()[0])

    def measurement_rows(self, uid: Optional[int] = None, round_number: Optional[int] = None) -> list[sqlite3.Row]:
        clauses, args = [], []
        if uid is not None:
            clauses.append("uid = ?")
            args.append(uid)
        if round_number is not None:
            clauses.append("round = ?")
            args.append(round_number)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._conn.execute(f"SELECT * FROM measurements {where} ORDER BY id", args).fetchall()

    def committed_share(self, uid: int, hotkey: str, since: float) -> Optional[float]:
        """The share of a miner's completed answers since `since` that carried a state commitment (None: none
        measured)."""
        row = self._conn.execute("SELECT AVG(committed) FROM measurements WHERE uid = ? AND hotkey = ? AND "
                                 "outcome = 'completed' AND committed IS NOT NULL AND at >= ?",
                                 (uid, hotkey, since)).fetchone()
        return None if row[0] is None else float(row[0])

    def prune(self, before: float) -> int:
        """Forget measurements, failures and audits older than `before` (unix time)."""
        with self._transaction() as conn:
            dropped = conn.execute("DELETE FROM measurements WHERE at < ?", (before,)).rowcount
            conn.execute("DELETE FROM failures WHERE at < ?", (before,))
            conn.execute("DELETE FROM audits WHERE at < ?", (before,))
            conn.execute("DELETE FROM stage_checks WHERE at < ?", (before,))
        return dropped

    # ------------------------------------------------------------ failures and audits
    def add_failures(self, rows: Iterable[Mapping], round_number: int, source: str = "validator") -> None:
        """Rows with uid, hotkey, check, reason and optionally at, request_id, kind, hard."""
        now = time.time()
        values = [(r.get("at", now), round_number, r["uid"], r["hotkey"], r.get("request_id"), r.get("kind"),
                   r["check"], str(r["reason"])[:2000], int(bool(r.get("hard", False))), source) for r in rows]
        self._append("failures", ("at", "round", "uid", "hotkey", "request_id", "kind", "check_name", "reason",
                                  "hard", "source"), values)

    def failures(self, uid: Optional[int] = None, since: Optional[float] = None) -> list[sqlite3.Row]:
        clauses, args = [], []
        if uid is not None:
            clauses.append("uid = ?")
            args.append(uid)
        if since is not None:
            clauses.append("at >= ?")
            args.append(since)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._conn.execute(f"SELECT * FROM failures {where} ORDER BY id", args).fetchall()

    def add_audit(self, row: Mapping, round_number: int) -> None:
        fields = ("at", "uid", "hotkey", "request_id", "kind", "tier", "reference", "passed", "quality",
                  "mean_prob_diff", "positions", "greedy_mismatches", "outside_top_k", "disagreement", "error",
                  "failures", "cpu_s", "wall_s")
        values = [row.get(f) for f in fields]
        values[0] = values[0] or time.time()
        self._append("audits", ("round", *fields), [(round_number, *values)])

    def audits(self, uid: Optional[int] = None) -> list[sqlite3.Row]:
        if uid is None:
            return self._conn.execute("SELECT * FROM audits ORDER BY id").fetchall()
        return self._conn.execute("SELECT * FROM audits WHERE uid = ? ORDER BY id", (uid,)).fetchall()

    # ------------------------------------------------------------ scores and EMA
    def save_round(self, round_number: int, scores: Mapping[int, MinerScore], ema: Mapping[int, EmaEntry],
                   at: Optional[float] = None) -> None:
        """A round's scores and the new EMA, together: either both are saved or neither."""
        at = time.time() if at is None else at
        columns = ", ".join(f'"{f}"' for f in _SCORE_FIELDS)
        with self._transaction() as conn:
            conn.executemany(
                f"INSERT OR REPLACE INTO scores (round, uid, hotkey, at, {columns}, reasons, ema) "
                f"VALUES (?, ?, ?, ?, {', '.join('?' for _ in _SCORE_FIELDS)}, ?, ?)",
                [(round_number, s.uid, s.hotkey, at, *[_scalar(getattr(s, f)) for f in _SCORE_FIELDS],
                  json.dumps(s.reasons), float(ema[s.uid].value) if s.uid in ema else None)
                 for s in scores.values()])
            conn.execute("DELETE FROM ema")
            conn.executemany("INSERT INTO ema (uid, hotkey, value, round, updated_at) VALUES (?, ?, ?, ?, ?)",
                             [(uid, e.hotkey, float(e.value), round_number, at) for uid, e in ema.items()])
            self._set_meta(conn, "completed_round", round_number)

    def load_ema(self) -> dict[int, EmaEntry]:
        return {int(r["uid"]): EmaEntry(r["hotkey"], float(r["value"]))
                for r in self._conn.execute("SELECT uid, hotkey, value FROM ema")}

    def latest_scores(self) -> dict[int, sqlite3.Row]:
        """Each uid's most recent score row."""
        rows = self._conn.execute(
            "SELECT s.* FROM scores s JOIN (SELECT uid, MAX(round) AS r FROM scores GROUP BY uid) last "
            "ON s.uid = last.uid AND s.round = last.r").fetchall()
        return {int(r["uid"]): r for r in rows}

    def scores_of_round(self, round_number: int) -> dict[int, sqlite3.Row]:
        return {int(r["uid"]): r for r in
                self._conn.execute("SELECT * FROM scores WHERE round = ?", (round_number,)).fetchall()}

    # ------------------------------------------------------------ miners
    def save_miner(self, uid: int, hotkey: str, coldkey: str, url: Optional[str],
                   capabilities: Optional[dict] = None, capabilities_at: Optional[float] = None,
                   last_round: Optional[int] = None) -> None:
        """What the metagraph (and /v1/capabilities) said about a uid. A new hotkey on the uid drops the
        old one's capabilities and evaluation history."""
        now = time.time()
        with self._transaction() as conn:
            old = conn.execute("SELECT hotkey, capabilities, capabilities_at, last_round FROM miners WHERE uid = ?",
                               (uid,)).fetchone()
            same = old is not None and old["hotkey"] == hotkey
            caps_text = json.dumps(capabilities) if capabilities is not None else (old["capabilities"] if same else None)
            caps_at = capabilities_at if capabilities is not None else (old["capabilities_at"] if same else None)
            last = last_round if last_round is not None else (old["last_round"] if same else None)
            conn.execute("INSERT OR REPLACE INTO miners (uid, hotkey, coldkey, url, capabilities, capabilities_at, "
                         "last_round, seen_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (uid, hotkey, coldkey, url, caps_text, caps_at, last, now))

    def forget_miners(self, keep_uids: Iterable[int]) -> None:
        keep = sorted(set(int(u) for u in keep_uids))
        with self._transaction() as conn:
            if keep:
                conn.execute(f"DELETE FROM miners WHERE uid NOT IN ({', '.join('?' for _ in keep)})", keep)
            else:
                conn.execute("DELETE FROM miners")

    def miners(self) -> dict[int, StoredMiner]:
        out = {}
        for r in self._conn.execute("SELECT * FROM miners ORDER BY uid"):
            out[int(r["uid"])] = StoredMiner(
                uid=int(r["uid"]), hotkey=r["hotkey"], coldkey=r["coldkey"], url=r["url"],
                capabilities=json.loads(r["capabilities"]) if r["capabilities"] else None,
                capabilities_at=r["capabilities_at"], last_round=r["last_round"], seen_at=r["seen_at"])
        return out

    # ------------------------------------------------------------ weights
    def save_weights(self, weights: Mapping[int, float], hotkeys: Mapping[int, str], block: Optional[int],
                     version_key: int, at: Optional[float] = None) -> None:
        at = time.time() if at is None else at
        with self._transaction() as conn:
            conn.execute("DELETE FROM weights")
            conn.executemany("INSERT INTO weights (uid, hotkey, weight) VALUES (?, ?, ?)",
                             [(int(uid), hotkeys.get(uid), float(w)) for uid, w in weights.items()])
            self._set_meta(conn, "weights_set_at", repr(at))
            self._set_meta(conn, "weights_block", "" if block is None else block)
            self._set_meta(conn, "weights_version_key", version_key)
            conn.execute("INSERT INTO weight_attempts (at, block, ok, error, weights) VALUES (?, ?, 1, NULL, ?)",
                         (at, block, json.dumps({str(k): v for k, v in weights.items()})))

    def record_weight_attempt(self, ok: bool, error: Optional[str], block: Optional[int] = None,
                              weights: Optional[Mapping[int, float]] = None) -> None:
        with self._transaction() as conn:
            conn.execute("INSERT INTO weight_attempts (at, block, ok, error, weights) VALUES (?, ?, ?, ?, ?)",
                         (time.time(), block, int(ok), error,
                          None if weights is None else json.dumps({str(k): v for k, v in weights.items()})))

    def weight_attempts(self) -> list[sqlite3.Row]:
        return self._conn.execute("SELECT * FROM weight_attempts ORDER BY id").fetchall()

    def last_weights(self) -> LastWeights:
        rows = self._conn.execute("SELECT uid, hotkey, weight FROM weights").fetchall()
        set_at = self._meta("weights_set_at")
        block = self._meta("weights_block")
        key = self._meta("weights_version_key")
        return LastWeights(
            weights={int(r["uid"]): float(r["weight"]) for r in rows},
            hotkeys={int(r["uid"]): r["hotkey"] for r in rows},
            set_at=float(set_at) if set_at else None,
            block=int(block) if block else None,
            version_key=int(key) if key else None,
        )

    # ------------------------------------------------------------ canaries
    def save_canaries(self, entries: Iterable[tuple[str, dict]]) -> None:
        with self._transaction() as conn:
            conn.executemany("INSERT OR IGNORE INTO canaries (id, body) VALUES (?, ?)",
                             [(cid, json.dumps(body)) for cid, body in entries])

    def stored_canaries(self) -> list[dict]:
        return [json.loads(r["body"]) for r in self._conn.execute("SELECT body FROM canaries WHERE body != '{}' ORDER BY rowid")]

    def mark_canaries_used(self, canary_ids: Iterable[str]) -> None:
        ids = list(canary_ids)
        if not ids:
            return
        with self._transaction() as conn:
            conn.executemany("INSERT OR IGNORE INTO canaries (id, body) VALUES (?, '{}')", [(c,) for c in ids])
            conn.executemany("UPDATE canaries SET used = 1 WHERE id = ?", [(c,) for c in ids])

    def used_canaries(self) -> set[str]:
        return {r[0] for r in self._conn.execute("SELECT id FROM canaries WHERE used = 1")}

    # ------------------------------------------------------------ swarm stage miners
    _STAGE_CHECK_FIELDS = ("at", "round", "uid", "hotkey", "layers", "kind", "passed", "blame", "reason", "tokens",
                           "steps", "median_rel_l2", "bad_fraction", "step_ms", "cpu_s", "wall_s", "commitment",
                           "seed", "nonce", "numerics", "bad", "q90_rel_l2", "worst_rel_l2", "outside", "route_id",
                           "session", "request_id", "origin", "bytes_read", "weights_read", "peak_resident",
                           "peak_rss", "check_flops", "checked_flops")

    def add_stage_check(self, row: Mapping) -> None:
        values = [row.get(f) for f in self._STAGE_CHECK_FIELDS]
        values[0] = values[0] or time.time()
        values[1] = values[1] or 0
        self._append("stage_checks", self._STAGE_CHECK_FIELDS, [tuple(values)])

    def stage_checks(self, since: Optional[float] = None, hotkey: Optional[str] = None,
                     kinds: Optional[Sequence[str]] = None, without: Sequence[str] = (),
                     blamed: bool = False) -> list[sqlite3.Row]:
        """Rows of stage_checks since `since`, oldest first: of one hotkey, of some kinds, without others, only
        those that blame (the credited work is most of the table: readers that do not add it up leave it out)."""
        clauses, args = ["at >= ?"], [since or 0.0]
        if hotkey is not None:
            clauses.append("hotkey = ?")
            args.append(hotkey)
        if kinds is not None:
            clauses.append(f"kind IN ({', '.join('?' for _ in kinds)})")
            args += list(kinds)
        if without:
            clauses.append(f"kind NOT IN ({', '.join('?' for _ in without)})")
            args += list(without)
        if blamed:
            clauses.append("blame = 1")
        return self._conn.execute(f"SELECT * FROM stage_checks WHERE {' AND '.join(clauses)} ORDER BY id",
                                  args).fetchall()

    def stage_totals(self, since: float, work_kinds: Sequence[str], sampled_kinds: Sequence[str],
                     by: str = "hotkey") -> dict[str, StageTotals]:
        """Per hotkey (or per `origin`: the driver) since `since`: layer-tokens credited of each of `work_kinds`, and
        how many rows of each of `sampled_kinds`; added up by SQLite, not read row by row."""
        if by not in ("hotkey", "origin"):
            raise ValueError(f"by must be hotkey or origin, got {by!r}")
        kinds = list(work_kinds) + list(sampled_kinds)
        rows = self._conn.execute(
            f"SELECT {by}, kind, COALESCE(SUM(tokens), 0), COUNT(*) FROM stage_checks WHERE at >= ? AND kind IN "
            f"({', '.join('?' for _ in kinds)}) GROUP BY {by}, kind", [since, *kinds])
        out: dict[str, StageTotals] = {}
        for who, kind, tokens, count in rows:
            totals = out.setdefault(who, StageTotals())
            if kind in work_kinds:
                totals.tokens[kind] = int(tokens)
            else:
                totals.rows[kind] = int(count)
        return out

    def request_measurement(self, request_id: str, hotkey: str) -> Optional[sqlite3.Row]:
        """The measurement of the request `request_id` this validator sent to `hotkey`, if it has one."""
        return self._conn.execute("SELECT * FROM measurements WHERE request_id = ? AND hotkey = ? ORDER BY id DESC "
                                  "LIMIT 1", (request_id, hotkey)).fetchone()

    def credited_request_tokens(self, request_id: str) -> int:
        """Layer-tokens of route work already credited for the request `request_id`."""
        row = self._conn.execute("SELECT COALESCE(SUM(tokens), 0) FROM stage_checks WHERE request_id = ? AND "
                                 "kind = 'route_work'", (request_id,)).fetchone()
        return int(row[0])

    def blamed_stages(self, since: float) -> dict[str, tuple[float, str]]:
        """Stage miners blamed since `since` (not route drivers: their blame is for receipts): hotkey -> (when it
        was first blamed, why)."""
        out: dict[str, tuple[float, str]] = {}
        for hotkey, at, reason in self._conn.execute("SELECT hotkey, at, reason FROM stage_checks WHERE blame = 1 "
                                                     "AND at >= ? AND kind != 'route_receipts' ORDER BY id", (since,)):
            out.setdefault(hotkey, (at, reason))
        return out

    def route_stages(self, request_id: str, driver: str) -> set[str]:
        """The stages credited with route work of `driver` for the request `request_id` (its route)."""
        return {r[0] for r in self._conn.execute("SELECT DISTINCT hotkey FROM stage_checks WHERE request_id = ? AND "
                                                 "origin = ? AND kind = 'route_work'", (request_id, driver))}

    def excuse_measurement(self, request_id: str, hotkey: str, why: str) -> None:
        """The answer to `request_id` of `hotkey` counts neither as verified nor as a failure: `why`."""
        with self._transaction() as conn:
            conn.execute("UPDATE measurements SET outcome = 'excused', audits = 0, audit_failures = 0, "
                         "hard_failure = 0, quality = NULL, failures = ? WHERE request_id = ? AND hotkey = ?",
                         (why, request_id, hotkey))

    def stage_blame(self, hotkey: str, since: float, kind: Optional[str] = None) -> list[sqlite3.Row]:
        """The checks that blamed `hotkey` since `since` (of one kind, when given)."""
        return self.stage_checks(since, hotkey, kinds=None if kind is None else [kind], blamed=True)

    def save_stage_miners(self, rows: Iterable[Mapping]) -> None:
        now = time.time()
        with self._transaction() as conn:
            conn.executemany("INSERT OR REPLACE INTO stage_miners (uid, hotkey, coldkey, url, layers, fingerprint, "
                             "step_ms, seen_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             [(r["uid"], r["hotkey"], r.get("coldkey"), r.get("url"), r["layers"],
                               r.get("fingerprint"), r.get("step_ms"), now) for r in rows])

    def stage_miners(self) -> dict[int, sqlite3.Row]:
        return {int(r["uid"]): r for r in self._conn.execute("SELECT * FROM stage_miners ORDER BY uid")}

    # ------------------------------------------------------------ reading for status
    def meta(self) -> dict[str, str]:
        return {r["key"]: r["value"] for r in self._conn.execute("SELECT key, value FROM meta")}


def _stored_version(conn: sqlite3.Connection) -> Optional[int]:
    """The schema version the file records, or None when it is not a validator database."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.OperationalError:  # no meta table
        return None
    return None if row is None else int(row[0])


def _scalar(value):
    if isinstance(value, bool):
        return int(value)
    return value


def _insert_sql(table: str, columns: Sequence[str]) -> str:
    names = ", ".join(f'"{c}"' for c in columns)
    return f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' for _ in columns)})"


def _measurement_values(m: Measurement) -> list:
    return [_scalar(getattr(m, c)) for c in COLUMNS]


__all__ = ["MIGRATIONS", "OWN_WORK_KINDS", "SCHEMA_VERSION", "SOURCES", "WORK_KINDS", "LastWeights", "Migration",
           "StageTotals", "StoredMiner", "ValidatorStore", "ValidatorStoreError"]
