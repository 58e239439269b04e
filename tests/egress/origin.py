"""An HTTPS origin for the egress tests (tests/it/egress.rs), run by the
test inside a network namespace of its own: serves the files under ROOT to
requests whose Authorization header is exactly $ORIGIN_AUTH, answers 401
otherwise, and prints one line per request (method, path, whether the
credential was right). Prints "ready" once it listens."""

import http.server
import os
import ssl
import sys


def main():
    addr, port, root, cert, key = sys.argv[1:6]
    want = os.environ["ORIGIN_AUTH"]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            ok = self.headers.get("Authorization") == want
            path = self.path.split("?", 1)[0]
            print(f"{self.command} {path} auth={'ok' if ok else 'no'}", flush=True)
            if not ok:
                body = b"credential required\n"
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="origin"')
            else:
                full = os.path.realpath(os.path.join(root, path.lstrip("/")))
                if os.path.isdir(full):
                    full = os.path.join(full, "index.html")
                if not full.startswith(os.path.realpath(root)) or not os.path.isfile(full):
                    body = b"not found\n"
                    self.send_response(404)
                else:
                    with open(full, "rb") as f:
                        body = f.read()
                    self.send_response(200)
                    if body[:1] == b"{":
                        self.send_header("Content-Type", "application/json")
                    elif full.endswith(".html"):
                        self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer((addr, int(port)), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    print("ready", flush=True)
    srv.serve_forever()


main()
