"""A guarded listener under a connection flood at a low descriptor limit: asyncio accepts a whole burst of
connections before the guard can refuse any, so the burst is kept inside the descriptor reserve
(protocol.http_server.ACCEPT_BURST) and accept() never fails with EMFILE, while the kernel's queue keeps the
site's backlog. The server is a real process with RLIMIT_NOFILE 256; the flood is 600 raw connections,
the last 350 queued while the server is stopped, so they meet it as one burst."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVER = textwrap.dedent("""
    import asyncio, logging, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    logging.basicConfig(level=logging.INFO)
    from aiohttp import web
    from protocol.http_server import ConnectionGuard, GuardSettings, GuardedSite, runner_options

    async def ok(request):
        return web.Response(text="ok")

    async def main():
        guard = ConnectionGuard(GuardSettings(), "flood test")
        app = web.Application(middlewares=[guard.middleware])
        app.router.add_get("/", ok)
        runner = web.AppRunner(app, **runner_options(guard.settings))
        await runner.setup()
        site = GuardedSite(runner, guard, "127.0.0.1", 0)
        await site.start()
        print("port", site._server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_a_flood_never_runs_the_listener_out_of_descriptors(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, stdout=subprocess.PIPE, stderr=out,
                                text=True)
    socks = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), log.read_text()[-2000:]
        port = int(line.split()[1])
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert listening.split()[2] == "128", listening  # the kernel queue keeps the site's backlog
        def flood(n):
            for i in range(n):  # from several loopback addresses, past the guard's per-address cap
                s = socket.socket()
                s.bind((f"127.0.0.{2 + i % 6}", 0))
                s.setblocking(False)
                try:
                    s.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                socks.append(s)

        flood(250)  # the guard admits its budget of idle connections (they wait out the header deadline)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)  # then a full accept queue meets the listener at one wake-up
        try:
            flood(350)
            time.sleep(0.5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(2.0)
        for s in socks:
            s.close()
        socks.clear()
        deadline = time.monotonic() + 20
        while True:  # once the flood is gone, a request is served again
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as resp:
                    assert resp.read() == b"ok"
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
        text = log.read_text()
        assert "Too many open files" not in text and "Traceback" not in text, text[-3000:]
        assert "refused" in text or proc.poll() is None
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(10)
