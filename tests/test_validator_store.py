"""The validator's SQLite store, its settings and the gateway's view: real SQLite
files, real measurements from scoring.metrics, no miners."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from neurons.validator_app import store as store_module
from neurons.validator_app.rounds import ValidatorState
from neurons.validator_app.settings import ValidatorSettings, ValidatorSetupError, read_validator_settings
from neurons.validator_app.status import status_report
from neurons.validator_app.store import MIGRATIONS, SCHEMA_VERSION, Migration, ValidatorStore, ValidatorStoreError
from scoring.config import ScoringConfig
from scoring.metrics import COLUMNS, Measurement
from scoring.rewards import EmaEntry, score_miners, update_ema

ROOT = Path(__file__).resolve().parent.parent
HOTKEY_A = "5GrwvaDF2WmY8NX3r1kiSNNtFvzh2uVwoMf9YmwkCi6UEcMa"
HOTKEY_B = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"


def measurement(uid: int, hotkey: str, at: float, kind: str = "chat", outcome: str = "completed", **fields):
    base = dict(uid=uid, hotkey=hotkey, at=at, kind=kind, request_id=f"r{uid}-{at}", outcome=outcome,
                tier0_ok=outcome == "completed", prompt_tokens=100, completion_tokens=40, ttft_s=0.2, total_s=1.0,
                decode_tps=50.0, ttft_per_1k_s=2.0)
    base.update(fields)
    return Measurement(**base)


def test_measurements_round_trip_exactly(tmp_path):
    db = tmp_path / "v.sqlite"
    now = 1_000_000.0
    rows = [
        measurement(1, HOTKEY_A, now - 10),
        measurement(1, HOTKEY_A, now - 5, kind="long_context", long_context_success=True, audits=1, quality=0.75),
        measurement(2, HOTKEY_B, now - 4, outcome="timeout", tier0_ok=False, ttft_s=None, decode_tps=None,
                    failures="first_byte timeout after 60 s"),
        measurement(2, HOTKEY_B, now - 3, kind="burst_aggregate", burst_id="b1", burst_tokens=80, burst_wall_s=2.5,
                    hard_failure=True, failures="buffered_stream (hard): ..."),
    ]
    with ValidatorStore(db) as store:
        round_number = store.begin_round()
        store.add_measurements([(m, 0.001) for m in rows], round_number)
    with ValidatorStore(db) as store:
        window, last_id = store.load_window(window_s=3600, now=now)
        assert sorted(window.rows(), key=lambda m: m.at) == rows  # every field, every type
        assert last_id == 4 and store.round == 1
        assert [r["tier0_cpu_s"] for r in store.measurement_rows()] == [0.001] * 4
        # Older than the window: not loaded, and pruned on request.
        window, _ = store.load_window(window_s=3.5, now=now)
        assert [m.at for m in window.rows()] == [now - 3]
        assert store.prune(now - 4.5) == 2 and store.measurement_count() == 2


def test_round_scores_and_ema_are_saved_together(tmp_path):
    config = ScoringConfig()
    now = 2_000_000.0
    with ValidatorStore(tmp_path / "v.sqlite") as store:
        number = store.begin_round()
        ms = [measurement(1, HOTKEY_A, now - i) for i in range(30)] + [measurement(2, HOTKEY_B, now - 1, decode_tps=25.0)]
        store.add_measurements([(m, None) for m in ms], number)
        window, _ = store.load_window(config.window_s, now=now)
        scores = score_miners(window, config, now, {1: HOTKEY_A, 2: HOTKEY_B}, {1: "c1", 2: "c2"})
        ema = update_ema({}, scores, config.ema_alpha)
        store.save_round(number, scores, ema, at=now)
        assert store.load_ema() == ema and store.completed_round == number
        saved = store.scores_of_round(number)
        assert saved[1]["score"] == pytest.approx(scores[1].score) and saved[1]["ema"] == pytest.approx(ema[1].value)
        assert json.loads(saved[2]["reasons"]) == scores[2].reasons
        # A failure in the middle of saving leaves the previous round's state whole.
        bad_ema = {1: EmaEntry(HOTKEY_A, 0.5), 2: EmaEntry(None, 0.1)}  # NOT NULL hotkey: the insert fails
        with pytest.raises(sqlite3.IntegrityError):
            store.save_round(number + 1, scores, bad_ema)
        assert store.load_ema() == ema and store.completed_round == number


def test_weights_miners_canaries_and_failures(tmp_path):
    with ValidatorStore(tmp_path / "v.sqlite") as store:
        store.save_miner(3, HOTKEY_A, "cold", "http://127.0.0.1:9000", {"model_id": "m"}, 10.0)
        store.save_miner(3, HOTKEY_A, "cold", "http://127.0.0.1:9001", last_round=4)  # keeps the capabilities
        assert store.miners()[3].capabilities == {"model_id": "m"} and store.miners()[3].last_round == 4
        store.save_miner(3, HOTKEY_B, "cold2", "http://127.0.0.1:9002")  # the uid changed hands
        assert store.miners()[3].capabilities is None and store.miners()[3].last_round is None
        store.forget_miners([])
        assert store.miners() == {}
        store.save_weights({3: 0.75, 5: 0.25}, {3: HOTKEY_A, 5: HOTKEY_B}, block=123, version_key=1002)
        last = store.last_weights()
        assert last.weights == {3: 0.75, 5: 0.25} and last.block == 123 and last.version_key == 1002
        store.record_weight_attempt(False, "RateLimited: too soon", weights={3: 1.0})
        assert [a["ok"] for a in store.weight_attempts()] == [1, 0]
        store.save_canaries([("c1", {"id": "c1", "prompt_ids": [1], "tokens": [2], "margins": [0.5]})])
        store.mark_canaries_used(["c1", "from-a-pool-file"])
        assert store.used_canaries() == {"c1", "from-a-pool-file"}
        assert [c["id"] for c in store.stored_canaries()] == ["c1"]
        store.add_failures([dict(uid=3, hotkey=HOTKEY_B, check="usage_completion", reason="40 vs 32", hard=True)], 1)
        assert [(f["check_name"], f["hard"]) for f in store.failures(3)] == [("usage_completion", 1)]


def test_schema_version_and_foreign_files_are_refused(tmp_path):
    db = tmp_path / "v.sqlite"
    ValidatorStore(db).close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    with pytest.raises(ValidatorStoreError, match="schema"):
        ValidatorStore(db)
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ValidatorStoreError, match="not a validator database"):
        ValidatorStore(other, readonly=True)
    with pytest.raises(ValidatorStoreError, match="no validator database"):
        ValidatorStore(tmp_path / "missing.sqlite", readonly=True)


def test_ranked_miners_and_status_view(tmp_path):
    db = tmp_path / "v.sqlite"
    with ValidatorStore(db) as store:
        for uid, hotkey in ((1, HOTKEY_A), (2, HOTKEY_B), (4, HOTKEY_A)):
            store.save_miner(uid, hotkey, f"c{uid}", f"http://127.0.0.1:{9000 + uid}")
        store.save_round(1, {}, {1: EmaEntry(HOTKEY_A, 0.2), 2: EmaEntry(HOTKEY_B, 0.4), 4: EmaEntry(HOTKEY_A, 0.0),
                                 7: EmaEntry(HOTKEY_B, 0.9)})  # uid 7: no endpoint known
    state = ValidatorState.open(db)
    ranked = state.ranked_miners()
    assert [(m.uid, m.url) for m in ranked] == [(2, "http://127.0.0.1:9002"), (1, "http://127.0.0.1:9001")]
    assert ranked[0].weight == pytest.approx(0.16 / 0.2) and ranked[1].weight == pytest.approx(0.04 / 0.2)
    assert [m.uid for m in state.ranked_miners(limit=1)] == [2]
    view = status_report(state.store)
    assert {m["uid"] for m in view["miners"]} == {1, 2, 4, 7}
    assert {m["zero_weight_reason"] for m in view["miners"]} == {"not scored yet"}  # no scores saved, no weights
    state.store.close()


def test_settings_from_flags_and_environment(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    argv = ["--netuid", "3", "--checkpoint", str(ckpt), "--requests-per-miner", "12", "--scoring-profile",
            "local_testnet", "--scoring-overrides", '{"chat_max_tokens": [64, 96]}', "--uids", "1,2", "--reference-engine"]
    settings = read_validator_settings(argv, environ={"K3_VALIDATOR_AUDIT_RATE": "0.5", "K3_VALIDATOR_DB": "/x.db",
                                                      "K3_VALIDATOR_ROUND_DEADLINE_S": "30"})
    assert isinstance(settings, ValidatorSettings) and settings.chain.netuid == 3 and settings.db == "/x.db"
    assert settings.rounds.deadline_s == 30 and settings.rounds.only_uids() == {1, 2}
    config = settings.scoring_config()
    assert (config.round_requests, config.audit_rate, config.chat_max_tokens) == (12, 0.5, (64, 96))
    assert config.long_context_sizes == ScoringConfig.local_testnet().long_context_sizes
    assert settings.problems() == []
    bad = read_validator_settings(["--netuid", "3", "--scoring-overrides", '{"no_such_field": 1}', "--uids", "x"])
    problems = " ".join(bad.problems())
    assert "--checkpoint is required" in problems and "no_such_field" in problems and "--uids" in problems
    assert "neither --reference-engine nor --canary-pool" in problems  # nothing trusted to settle audits
    with pytest.raises(ValidatorSetupError, match="chat_max_tokens"):
        read_validator_settings(["--netuid", "1", "--scoring-overrides", '{"chat_max_tokens": [8, 4]}']).scoring_config()


def test_help_and_status_commands():
    help_text = subprocess.run([sys.executable, "neurons/validator.py", "run", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout
    for flag in ("--round-interval-s", "--requests-per-miner", "--concurrency", "--round-deadline-s", "--audit-rate",
                 "--canary-pool", "--reference-engine", "--db", "K3_VALIDATOR_DB", "--wallet-name", "--network"):
        assert flag in help_text
    usage = subprocess.run([sys.executable, "neurons/validator.py", "bogus"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 2 and "run" in usage.stderr and "status" in usage.stderr



# ------------------------------------------------------------------ upgrades
def write_schema_v1_database(path: Path, measurements: list[Measurement]) -> None:
    """A database as the first release (schema 1, no migrations) left it after three rounds: its
    schema text, its meta rows, and rows in every table, written with plain SQL."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for statement in store_module._SCHEMA_V1.split(";"):
        if statement.strip():
            conn.execute(statement)
    meta = {"schema_version": "1", "created_at": "1000.0", "round": "3", "completed_round": "3",
            "weights_set_at": "1900.5", "weights_block": "321", "weights_version_key": "1000"}
    conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
    v1_columns = store_module._SCHEMA_V1_COLUMNS  # the measurement columns schema 1 had
    columns = ", ".join(f'"{c}"' for c in v1_columns)
    values = [dict(zip(COLUMNS, store_module._measurement_values(m))) for m in measurements]
    conn.executemany(f"INSERT INTO measurements (round, source, tier0_cpu_s, {columns}) "
                     f"VALUES (?, ?, ?, {', '.join('?' for _ in v1_columns)})",
                     [(3, "validator", 0.002, *(v[c] for c in v1_columns)) for v in values])
    conn.execute("INSERT INTO failures (at, round, uid, hotkey, request_id, kind, check_name, reason, hard, source) "
                 "VALUES (1500.0, 2, 2, ?, 'r2', 'chat', 'usage_completion', '40 vs 32', 1, 'validator')", (HOTKEY_B,))
    conn.execute("INSERT INTO audits (at, round, uid, hotkey, request_id, kind, tier, reference, passed, quality) "
                 "VALUES (1600.0, 3, 1, ?, 'r1', 'chat', 1, 'local', 1, 0.97)", (HOTKEY_A,))
    conn.execute('INSERT INTO scores (round, uid, hotkey, at, "score", "gate", coldkey, reasons, ema) '
                 "VALUES (3, 1, ?, 1800.0, 0.8, 1.0, 'c1', '[]', 0.4)", (HOTKEY_A,))
    conn.execute("INSERT INTO ema (uid, hotkey, value, round, updated_at) VALUES (1, ?, 0.4, 3, 1800.0)", (HOTKEY_A,))
    conn.execute("INSERT INTO miners (uid, hotkey, coldkey, url, capabilities, capabilities_at, last_round, seen_at) "
                 "VALUES (1, ?, 'c1', 'http://127.0.0.1:9001', '{\"model_id\": \"kimi-k3\"}', 1700.0, 3, 1800.0)",
                 (HOTKEY_A,))
    conn.execute("INSERT INTO weights (uid, hotkey, weight) VALUES (1, ?, 1.0)", (HOTKEY_A,))
    conn.execute("INSERT INTO weight_attempts (at, block, ok, error, weights) VALUES (1900.5, 321, 1, NULL, '{\"1\": 1.0}')")
    conn.execute("INSERT INTO canaries (id, body, used) VALUES ('c1', '{\"id\": \"c1\"}', 1)")
    conn.close()


def table_sql(path: Path) -> dict[str, str]:
    """Every table's and index's definition, as SQLite keeps it."""
    conn = sqlite3.connect(path)
    try:
        return {name: " ".join(sql.split()) for name, sql in
                conn.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%'")}
    finally:
        conn.close()


def test_a_schema_1_database_is_upgraded_with_its_data_intact(tmp_path):
    assert SCHEMA_VERSION >= 2 and [m.version for m in MIGRATIONS] == list(range(2, SCHEMA_VERSION + 1))
    db = tmp_path / "validator.sqlite"
    rows = [measurement(1, HOTKEY_A, 1800.0 - i, kind="long_context" if i == 2 else "chat",
                        long_context_success=True if i == 2 else None, quality=0.9) for i in range(5)]
    write_schema_v1_database(db, rows)
    before = table_sql(db)
    with pytest.raises(ValidatorStoreError, match="Start the validator once"):  # reading alone does not upgrade
        ValidatorStore(db, readonly=True)

    with ValidatorStore(db) as store:  # what `neurons/validator.py run` does at start
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION)
        assert [r["version"] for r in store.schema_history()] == list(range(2, SCHEMA_VERSION + 1))
        window, last_id = store.load_window(window_s=3600, now=1801.0)
        assert sorted(window.rows(), key=lambda m: m.at) == sorted(rows, key=lambda m: m.at) and last_id == 5
        assert [r["tier0_cpu_s"] for r in store.measurement_rows()] == [0.002] * 5
        assert (store.round, store.completed_round) == (3, 3)
        assert store.load_ema() == {1: EmaEntry(HOTKEY_A, 0.4)}
        assert store.latest_scores()[1]["score"] == 0.8
        assert store.miners()[1].capabilities == {"model_id": "kimi-k3"} and store.miners()[1].last_round == 3
        last = store.last_weights()
        assert (last.weights, last.block, last.version_key, last.set_at) == ({1: 1.0}, 321, 1000, 1900.5)
        assert [a["ok"] for a in store.weight_attempts()] == [1]
        assert store.used_canaries() == {"c1"}
        assert [(f["check_name"], f["reason"]) for f in store.failures(2)] == [("usage_completion", "40 vs 32")]
        assert [a["quality"] for a in store.audits(1)] == [0.97]
        # and it keeps working: the next round goes on from round 3
        assert store.begin_round() == 4
        store.add_measurements([(measurement(1, HOTKEY_A, 1802.0), None)], 4)
        assert store.measurement_count() == 6

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    # the file as it was, kept beside it
    backup = tmp_path / "validator.sqlite.schema-v1.bak"
    assert table_sql(backup) == before
    conn = sqlite3.connect(backup)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "1"
    assert conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0] == 5
    conn.close()

    # an upgraded file and a new one have the same tables and indexes
    fresh = tmp_path / "fresh.sqlite"
    ValidatorStore(fresh).close()
    assert table_sql(db) == table_sql(fresh)
    # opening again changes nothing: no second migration, no second copy
    with ValidatorStore(db) as store:
        assert [r["version"] for r in store.schema_history()] == list(range(2, SCHEMA_VERSION + 1))
    with ValidatorStore(db, readonly=True) as store:
        assert store.measurement_count() == 6
    assert sorted(p.name for p in tmp_path.glob("*.bak")) == ["validator.sqlite.schema-v1.bak"]


def test_a_failing_migration_leaves_the_file_at_its_last_good_version(tmp_path, monkeypatch):
    db = tmp_path / "validator.sqlite"
    write_schema_v1_database(db, [measurement(1, HOTKEY_A, 1800.0)])
    broken = Migration(SCHEMA_VERSION + 1, "a broken one", ("CREATE TABLE canaries (x)",))  # exists already
    monkeypatch.setattr(store_module, "MIGRATIONS", (*MIGRATIONS, broken))
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", broken.version)
    with pytest.raises(ValidatorStoreError, match="canaries"):
        ValidatorStore(db)
    monkeypatch.undo()
    with ValidatorStore(db) as store:  # the good migrations were kept, the broken one left no trace
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION)
        assert store.measurement_count() == 1
