"""The venv bootstrap of the Python tests that check us against a PyPI package (the GGUF oracle,
tiktoken conformance, the openai client): one pinned requirements file, one venv in the build tree.

ensure_venv() re-executes the calling script under the venv's python, creating the venv first
when it is missing or its requirements changed (a sha256 stamp). When pip cannot install the
packages the test is skipped (exit 77) with the reason, except under CI (CI=true), where that is a
failure so the check always runs there.
"""

import hashlib
import os
import shutil
import subprocess
import sys

SKIP = 77


def ensure_venv(venv, requirements, what, marker):
    """`what` names the packages in messages; `marker` is the environment variable that tells the
    re-executed script it already runs in the venv."""
    if os.environ.get(marker) == "1":
        return
    digest = hashlib.sha256(open(requirements, "rb").read()).hexdigest()
    stamp = os.path.join(venv, "requirements.sha256")
    python = os.path.join(venv, "bin", "python")
    if not (os.path.exists(stamp) and open(stamp).read() == digest and os.path.exists(python)):
        shutil.rmtree(venv, ignore_errors=True)
        steps = [[sys.executable, "-m", "venv", venv],
                 [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r",
                  requirements]]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                msg = ("cannot install %s (%s failed: %s)" %
                       (what, " ".join(cmd[:4]), (r.stderr or r.stdout).strip()[-800:]))
                if os.environ.get("CI") == "true":
                    print("FAILED: " + msg + " (CI=true: this check must run)")
                    sys.exit(1)
                print("SKIPPED: " + msg)
                sys.exit(SKIP)
        with open(stamp, "w") as f:
            f.write(digest)
    os.execve(python, [python] + sys.argv, dict(os.environ, **{marker: "1"}))
