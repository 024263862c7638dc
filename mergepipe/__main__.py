"""`python -m mergepipe`: the command line (mergepipe.cli)."""
from mergepipe.cli import main

raise SystemExit(main())
