from csmserve.apps.cli.main import main

raise SystemExit(main())
