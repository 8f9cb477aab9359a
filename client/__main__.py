"""`python -m client "prompt"`: stream a generation from a pagedserve server to the terminal."""

from client.cli import main

raise SystemExit(main())
