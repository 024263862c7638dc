from mergepipe.cli import main

raise SystemExit(main())
