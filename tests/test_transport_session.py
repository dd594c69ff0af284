"""The transport's live channel (vllm_fleet.host.transport.Session) as `vllm-fleet bench` and
`tune` use it: one JSON line out, one line back, before the host closes anything.

The channel is paramiko's own file objects (ChannelFile, ChannelStdinFile, ChannelStderrFile)
over a stand-in for the SSH channel that answers each line it is sent, the way benchhost.py does
over ssh. A reader that waits for a full 8 KiB buffer (io.TextIOWrapper over paramiko's
BufferedFile, whose read(n) blocks until n bytes or EOF) never returns the short answer: the
bench hung there on the lab.
"""

from __future__ import annotations

import queue
import threading

from paramiko.channel import ChannelFile, ChannelStderrFile, ChannelStdinFile

from vllm_fleet.host.transport import Session


class LineEchoChannel:
    """What the host's side does, reduced: each line sent is answered at once on stdout with
    ``{"got": N}`` (N its length), and with ``err N`` on stderr; EOF on stdin closes both."""

    def __init__(self) -> None:
        self.out: queue.Queue[bytes] = queue.Queue()
        self.err: queue.Queue[bytes] = queue.Queue()
        self._sent = b""
        self.closed = False

    def sendall(self, data: bytes) -> None:
        self._sent += data
        while b"\n" in self._sent:
            line, self._sent = self._sent.split(b"\n", 1)
            self.out.put(b'{"got": %d}\n' % len(line))
            self.err.put(b"err %d\n" % len(line))

    def shutdown_write(self) -> None:
        self.out.put(b"")
        self.err.put(b"")

    def _take(self, q: queue.Queue[bytes], size: int) -> bytes:
        data = q.get(timeout=30)  # what has arrived (a real channel blocks while nothing has)
        if not data:
            q.put(b"")  # end of file stays end of file
        return data[:size]

    def recv(self, size: int) -> bytes:
        return self._take(self.out, size)

    def recv_stderr(self, size: int) -> bytes:
        return self._take(self.err, size)

    def makefile(self, *params):
        return ChannelFile(self, *params)

    def makefile_stderr(self, *params):
        return ChannelStderrFile(self, *params)

    def makefile_stdin(self, *params):
        return ChannelStdinFile(self, *params)

    def close(self) -> None:
        self.closed = True


def _readline_within(stream, seconds: float) -> str | None:
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    t.start()
    t.join(seconds)
    return got[0] if got else None


def test_a_short_answer_line_is_read_as_soon_as_it_arrives():
    s = Session(chan=LineEchoChannel())
    for request in ('{"script": "...", "cfg": {}}', '{"op": "run", "concurrency": 2}'):
        s.stdin.write(request + "\n")
        s.stdin.flush()
        line = _readline_within(s.stdout, 5)
        assert line == '{"got": %d}\n' % len(request), f"no answer line within 5 s (got {line!r})"
        assert isinstance(line, str)
        assert _readline_within(s.stderr, 5) == f"err {len(request)}\n"


def test_closing_stdin_is_end_of_file_on_both_streams():
    s = Session(chan=LineEchoChannel())
    s.stdin.write('{"op": "quit"}\n')
    s.stdin.close()  # what HostSession.close does
    assert _readline_within(s.stdout, 5) == '{"got": 14}\n'
    assert _readline_within(s.stdout, 5) == ""
    assert list(s.stderr) == ["err 14\n"]  # the stderr drain's loop ends
