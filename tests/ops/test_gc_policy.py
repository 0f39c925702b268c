"""GC freeze after initialisation, in fresh processes (a freeze lasts for the process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


def test_freeze_collects_once_freezes_setup_objects_and_keeps_automatic_gc():
    result = _python(
        """
        import gc, weakref
        from magistral_cli.ops.gc_policy import freeze_after_init

        class Node:
            pass

        setup = [Node() for _ in range(1000)]  # long-lived objects from initialisation
        garbage = Node(); garbage.self = garbage  # a cycle that the collection must reclaim first
        dead = weakref.ref(garbage); del garbage
        count = freeze_after_init()
        assert dead() is None, "the cycle was frozen instead of collected"
        assert count == gc.get_freeze_count() and count >= 1000, count
        assert gc.isenabled()
        later = Node(); later.self = later  # created after the freeze: automatic GC still reclaims it
        ref = weakref.ref(later); del later
        gc.collect()
        assert ref() is None
        try:
            freeze_after_init()
        except RuntimeError as exc:
            assert "already called" in str(exc)
        else:
            raise AssertionError("a second call must raise")
        print("ok", count)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


def test_freeze_requires_automatic_gc():
    result = _python(
        """
        import gc
        from magistral_cli.errors import UserError
        from magistral_cli.ops.gc_policy import freeze_after_init

        gc.disable()
        try:
            freeze_after_init()
        except UserError as exc:
            assert "manual_gc_interval" in str(exc), exc
            assert gc.get_freeze_count() == 0
            print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_release_at_exit_hands_frozen_objects_back():
    result = _python(
        """
        import gc
        from magistral_cli.ops.gc_policy import freeze_after_init, release_at_exit

        release_at_exit()  # nothing frozen yet: a no-op
        assert gc.get_freeze_count() == 0
        setup = [object() for _ in range(100)]
        assert freeze_after_init() >= 100
        release_at_exit()
        assert gc.get_freeze_count() == 0
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
