from specsplit.cli import main

raise SystemExit(main())
