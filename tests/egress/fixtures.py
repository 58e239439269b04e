"""What the egress tests' origin serves (tests/it/egress.rs), made under
ROOT: a git repository for the dumb HTTP protocol (repo.git), a package
index in the simple API with one wheel (simple/, files/), and an npm
registry with one package (cubetestpkg, tarballs/). Prints nothing."""

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

root = sys.argv[1]
os.makedirs(root, exist_ok=True)


def run(*args, cwd=None):
    subprocess.run(args, cwd=cwd, check=True, capture_output=True)


# git: a bare repository with one commit, with info/refs for dumb HTTP.
work = os.path.join(root, "_work")
os.makedirs(work)
run("git", "init", "-q", "-b", "main", work)
with open(os.path.join(work, "README"), "w") as f:
    f.write("cloned through the egress proxy\n")
run("git", "-C", work, "add", "README")
run("git", "-C", work, "-c", "user.name=t", "-c", "user.email=t@test.invalid",
    "commit", "-q", "-m", "one")
run("git", "clone", "-q", "--bare", work, os.path.join(root, "repo.git"))
run("git", "-C", os.path.join(root, "repo.git"), "update-server-info")
subprocess.run(["rm", "-rf", work], check=True)

# pip: a wheel and its simple index.
name, version = "cubetestpkg", "1.0"
wheel = f"{name}-{version}-py3-none-any.whl"
files = {
    f"{name}/__init__.py": b"VALUE = 1\n",
    f"{name}-{version}.dist-info/METADATA":
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
    f"{name}-{version}.dist-info/WHEEL":
        b"Wheel-Version: 1.0\nGenerator: egress-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for p, data in files.items():
    d = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{p},sha256={d},{len(data)}\n"
record += f"{name}-{version}.dist-info/RECORD,,\n"
files[f"{name}-{version}.dist-info/RECORD"] = record.encode()
os.makedirs(os.path.join(root, "files"))
with zipfile.ZipFile(os.path.join(root, "files", wheel), "w") as z:
    for p, data in files.items():
        z.writestr(p, data)
os.makedirs(os.path.join(root, "simple", name))
with open(os.path.join(root, "simple", "index.html"), "w") as f:
    f.write(f'<html><body><a href="{name}/">{name}</a></body></html>\n')
with open(os.path.join(root, "simple", name, "index.html"), "w") as f:
    f.write(f'<html><body><a href="/files/{wheel}">{wheel}</a></body></html>\n')

# npm: a tarball and the package's document.
pkg = json.dumps({"name": name, "version": "1.0.0", "description": "egress test"}).encode()
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:gz") as t:
    info = tarfile.TarInfo("package/package.json")
    info.size = len(pkg)
    info.mode = 0o644
    t.addfile(info, io.BytesIO(pkg))
tgz = buf.getvalue()
os.makedirs(os.path.join(root, "tarballs"))
with open(os.path.join(root, "tarballs", f"{name}-1.0.0.tgz"), "wb") as f:
    f.write(tgz)
doc = {
    "name": name,
    "dist-tags": {"latest": "1.0.0"},
    "versions": {
        "1.0.0": {
            "name": name,
            "version": "1.0.0",
            "dist": {
                "tarball": f"https://npm.test.invalid/tarballs/{name}-1.0.0.tgz",
                "shasum": hashlib.sha1(tgz).hexdigest(),
                "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode(),
            },
        }
    },
}
with open(os.path.join(root, name), "w") as f:
    json.dump(doc, f)
