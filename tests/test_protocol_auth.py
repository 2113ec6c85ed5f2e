"""btauth/1 over real HTTP: sign, verify, every failure status, and the SQLite replay store
shared by two server "workers" and by several real processes."""
import multiprocessing
import time

import aiohttp
import pytest
from aiohttp import web
from bittensor import http_auth

from protocol.auth import (AUTH_ALLOWED_SKEW_S, AUTH_MAX_AGE_S, AuthFailure, SQLiteNonceStore, sign_request,
                           verify_request)

PATH = "/v1/generate"
BODY = b'{"request_id":"r-1","prompt":"hello","max_tokens":4}'


@pytest.fixture(scope="module")
def keys(tmp_path_factory, make_wallets):
    wallets = make_wallets(tmp_path_factory.mktemp("wallets"), ("validator", "miner", "other"))
    return {name: wallet.hotkey for name, wallet in wallets.items()}


async def start_worker(miner_ss58, store):
    """One server worker: verifies with its own store object, answers the caller."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            caller = verify_request(request.headers, body, request.method, request.raw_path, miner_ss58, store)
        except AuthFailure as failure:
            return web.Response(status=failure.status, body=failure.to_json(), content_type="application/json")
        return web.json_response({"caller": caller})

    app = web.Application()
    app.router.add_post(PATH, handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}{PATH}"


@pytest.fixture
async def two_workers(keys, tmp_path):
    store_path = tmp_path / "nonces.sqlite"
    stores = [SQLiteNonceStore(store_path), SQLiteNonceStore(store_path)]
    workers = [await start_worker(keys["miner"].ss58_address, store) for store in stores]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session, [url for _, url in workers]
    for runner, _ in workers:
        await runner.cleanup()
    for store in stores:
        store.close()


async def post(session, url, body, headers):
    async with session.post(url, data=body, headers=headers) as response:
        return response.status, await response.json()


def signed(keys, body=BODY, receiver="miner", **kwargs):
    return sign_request(keys["validator"], "POST", PATH, body, keys[receiver].ss58_address, **kwargs)


async def test_signed_request_is_accepted_and_names_the_caller(keys, two_workers):
    session, (url, _) = two_workers
    status, answer = await post(session, url, BODY, signed(keys))
    assert (status, answer) == (200, {"caller": keys["validator"].ss58_address})


async def test_tampered_body_is_401(keys, two_workers):
    session, (url, _) = two_workers
    status, answer = await post(session, url, BODY.replace(b"hello", b"hellO"), signed(keys))
    assert status == 401 and answer["error"]["code"] == "bad_signature"


async def test_request_signed_for_another_path_is_401(keys, two_workers):
    session, (url, _) = two_workers
    headers = sign_request(keys["validator"], "POST", "/v1/score", BODY, keys["miner"].ss58_address)
    status, answer = await post(session, url, BODY, headers)
    assert status == 401 and answer["error"]["code"] == "bad_signature"


async def test_replay_through_another_worker_is_401(keys, two_workers):
    session, (first, second) = two_workers
    headers = signed(keys)
    assert (await post(session, first, BODY, headers))[0] == 200
    status, answer = await post(session, second, BODY, headers)
    assert status == 401 and answer["error"]["code"] == "replayed_request"
    status, answer = await post(session, first, BODY, headers)
    assert status == 401 and answer["error"]["code"] == "replayed_request"
    # a fresh signature of the same body is a new request
    assert (await post(session, second, BODY, signed(keys)))[0] == 200


async def test_stale_and_future_timestamps_are_401(keys, two_workers):
    session, (url, _) = two_workers
    old = time.time_ns() - int((AUTH_MAX_AGE_S + 1) * 1e9)
    status, answer = await post(session, url, BODY, signed(keys, nonce_ns=old))
    assert status == 401 and answer["error"]["code"] == "stale_request"
    ahead = time.time_ns() + int((AUTH_ALLOWED_SKEW_S + 1) * 1e9)
    status, answer = await post(session, url, BODY, signed(keys, nonce_ns=ahead))
    assert status == 401 and answer["error"]["code"] == "stale_request"
    # inside the window: a few seconds old is still fine
    recent = time.time_ns() - int(3e9)
    assert (await post(session, url, BODY, signed(keys, nonce_ns=recent)))[0] == 200


async def test_wrong_receiver_is_403(keys, two_workers):
    session, (url, _) = two_workers
    status, answer = await post(session, url, BODY, signed(keys, receiver="other"))
    assert status == 403 and answer["error"]["code"] == "wrong_receiver"


async def test_missing_headers_are_401_with_a_clear_message(keys, two_workers):
    session, (url, _) = two_workers
    status, answer = await post(session, url, BODY, {})
    assert status == 401 and answer["error"]["code"] == "missing_auth"
    assert "X-Bittensor-Signature" in answer["error"]["message"]
    assert "http_auth.sign" in answer["error"]["message"]
    # an unbound signature (no receiver) is refused the same way
    unbound = http_auth.sign(keys["validator"], method="POST", path=PATH, body=BODY)
    status, answer = await post(session, url, BODY, unbound)
    assert status == 401 and "X-Bittensor-Receiver" in answer["error"]["message"]


async def test_garbled_signature_is_401(keys, two_workers):
    session, (url, _) = two_workers
    headers = signed(keys)
    headers[http_auth.HEADER_SIGNATURE] = "0xnothex"
    status, answer = await post(session, url, BODY, headers)
    assert status == 401 and answer["error"]["code"] == "malformed_auth"


def test_store_rejects_a_retention_shorter_than_the_window(tmp_path):
    with pytest.raises(ValueError, match="retention"):
        SQLiteNonceStore(tmp_path / "n.sqlite", retention_s=AUTH_MAX_AGE_S)


def test_store_forgets_after_retention(tmp_path):
    store = SQLiteNonceStore(tmp_path / "n.sqlite", retention_s=AUTH_MAX_AGE_S + AUTH_ALLOWED_SKEW_S)
    assert store.check_and_store("hk", 1) is True
    assert store.check_and_store("hk", 1) is False
    assert store.check_and_store("other", 1) is True
    assert store.check_and_store("hk", 2**70) is True  # beyond SQLite integers, still exact
    assert store.check_and_store("hk", 2**70 + 1) is True
    assert store.check_and_store("hk", 2**70) is False
    # age the rows instead of sleeping for the retention period
    store._connection.execute("UPDATE btauth_nonces SET seen_at = seen_at - 100")
    store._next_prune = 0.0
    assert store.check_and_store("hk", 3) is True
    count = store._connection.execute("SELECT COUNT(*) FROM btauth_nonces").fetchone()[0]
    assert count == 1
    store.close()


def _race(path, start_at, results):
    store = SQLiteNonceStore(path)
    while time.time() < start_at:
        pass
    results.put(sum(store.check_and_store("hk", nonce) for nonce in range(300)))


def test_processes_racing_on_the_same_nonces_accept_each_once(tmp_path):
    path = tmp_path / "shared.sqlite"
    SQLiteNonceStore(path).close()  # create the schema once
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    start_at = time.time() + 0.5
    workers = [context.Process(target=_race, args=(path, start_at, results)) for _ in range(4)]
    for worker in workers:
        worker.start()
    accepted = [results.get(timeout=30) for _ in workers]
    for worker in workers:
        worker.join(timeout=10)
        assert worker.exitcode == 0
    assert sum(accepted) == 300
