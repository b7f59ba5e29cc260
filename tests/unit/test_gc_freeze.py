"""miles/utils/gc_freeze.py: what is alive at the freeze leaves later collections; what comes after does not."""

import subprocess
import sys
import textwrap


def test_frozen_objects_leave_later_collections_and_new_garbage_is_still_collected():
    script = textwrap.dedent(
        """
        import gc, weakref
        from miles.utils.gc_freeze import freeze_heap
        kept = [[i] for i in range(200_000)]  # a model's worth of long-lived containers
        before = len(gc.get_objects())
        freeze_heap("test")
        assert gc.get_freeze_count() >= 200_000
        assert len(gc.get_objects()) < before - 200_000  # collections no longer walk them

        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze
        probe = weakref.ref(a)
        del a, b
        gc.collect()
        assert probe() is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
