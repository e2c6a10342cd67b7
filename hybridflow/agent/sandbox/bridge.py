"""The endpoint bridge inside a sandbox: the program a sandboxed black-box agent runs under
(``python3 -I -S -B bridge.py SOCKET PORT -- ARGV...``; stdlib only, imported by nothing).

Why: the sandbox's network namespace reaches nothing outside it, and an unmodified ``openai``
client wants an ``http://host:port`` URL. The run serves its endpoint on a Unix socket as well,
and the sandbox binds that one socket in (``Sandbox.run(sockets=...)``). This bridge listens on
127.0.0.1:PORT of the sandbox's own loopback and copies each connection's bytes to and from the
socket; it starts ARGV (the agent) as its child with the environment it got, waits for it, and
exits with the child's status (128 + N when signal N ended it). It runs under the same limits,
filter and identity as the agent: it can reach nothing the agent could not reach through it.
"""

import asyncio
import sys

CHUNK = 65536


async def copy(reader, writer):
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def main(path, port, argv):
    async def connection(client_r, client_w):
        try:
            server_r, server_w = await asyncio.open_unix_connection(path)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(copy(client_r, server_w), copy(server_r, client_w))
        for w in (client_w, server_w):
            w.close()

    server = await asyncio.start_server(connection, "127.0.0.1", port)
    child = await asyncio.create_subprocess_exec(*argv)  # stdin, stdout, stderr and environment: ours
    code = await child.wait()
    server.close()  # open connections go with the loop (asyncio.run cancels their tasks)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sep = sys.argv.index("--")
    sys.exit(asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[sep + 1:])))
