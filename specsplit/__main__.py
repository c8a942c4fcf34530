from specsplit.cli.commands import main

raise SystemExit(main())
