"""A derandomized run draws the same cases on every runner: what a worker happens to have
imported (test order, worker count, the adopter's own modules) does not change them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# Draws 200 seeds the way a gate test does, after importing the modules named in argv.
DRAW = textwrap.dedent("""
    import importlib, json, sys
    from hypothesis import given, settings
    from attncheck import profiles, strategies as S
    for name in sys.argv[1:]:
        importlib.import_module(name)
    drawn = []

    @settings(settings.get_profile("ci"), max_examples=200)
    @given(S.seeds)
    def draw(seed):
        drawn.append(seed)

    draw()
    print(json.dumps(drawn))
""")
# A local module full of literals inside the seeds' range, as any kernel repository has.
LITERALS = "\n".join(f"C{i} = {7919 * i + 13}" for i in range(300))


def _draws(tmp_path, *modules: str) -> list[int]:
    path = os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))
    out = subprocess.run([sys.executable, "-c", DRAW, *modules], cwd=tmp_path, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": path})
    return json.loads(out.stdout)


def test_draws_do_not_depend_on_the_modules_loaded(tmp_path):
    (tmp_path / "kernel_constants.py").write_text(LITERALS)
    plain = _draws(tmp_path)
    assert len(plain) == 200 and len(set(plain)) > 150, plain[:10]
    assert _draws(tmp_path, "kernel_constants") == plain
