"""``tierkv serve`` whose model takes 60 s more to load: ``python slow_load.py SERVE-ARGS...``, to stop
it mid-load for real (the server, its socket and its signals are the real ones)."""
import sys
import time

import tierkv.session


class SlowSession(tierkv.session.Session):
    def __init__(self, *args, **kwargs) -> None:
        time.sleep(60)
        super().__init__(*args, **kwargs)


tierkv.session.Session = SlowSession
if __name__ == "__main__":
    from tierkv.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
