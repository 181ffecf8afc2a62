"""A process's exit codes, and what each asks of systemd (ops/systemd: Restart=on-failure,
RestartPreventExitStatus=2 4; docs/runbook.md, "Exit codes")."""

EXIT_OK = 0
EXIT_INTERNAL_ERROR = 1  # a bug: restarted
EXIT_CONFIG = 2  # the config is invalid or unreadable, or names no such node: not restarted, an operator fixes it
EXIT_NOT_HERE = 3  # an address or interface the node binds is not on this host (not yet, at boot): restarted
EXIT_INVARIANT = 4  # the node found its own state impossible: not restarted, an operator reads its log first
EXIT_JOURNAL_DAMAGED = 5  # restarted; the restart cuts the journal there (runtime/storage/journal_repair.py)
