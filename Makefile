# Two commands do all the set-up: `make demo` and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_GET := DEBIAN_FRONTEND=noninteractive apt-get -y -qq

.PHONY: constraints demo test test-fast test-pure test-pure-fast test-sanitize test-loaded soak bench sysdeps clean

$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard */_*.c) $(wildcard */_*.h)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The versions the tests run with, for every host's install (docs/runbook.md): after changing a dependency.
constraints:
	python3 -m venv /tmp/tape-constraints && /tmp/tape-constraints/bin/pip install -q --upgrade pip
	/tmp/tape-constraints/bin/pip install -q -e '.[test]'
	{ sed -n '1,2p' constraints.txt; /tmp/tape-constraints/bin/pip freeze --exclude-editable; } > constraints.new
	mv constraints.new constraints.txt; rm -rf /tmp/tape-constraints

# Java (for PySpark), tshark (the independent MoldUDP64 decoder the tests use), nftables and
# ethtool (loss and a forwarder on the LAN tests' links), tmux (tape watch's live view, read as a
# person sees it), Prometheus and promtool (the alert rules).
sysdeps:
	@command -v java >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing a headless JRE for PySpark"; $(APT_GET) update && $(APT_GET) install openjdk-17-jre-headless >/dev/null; \
	  else echo "PySpark needs Java 17+: install a JRE (e.g. apt-get install openjdk-17-jre-headless)"; exit 1; fi; }
	@command -v tshark >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing tshark (independent MoldUDP64 decoder for the tests)"; \
	    $(APT_GET) update >/dev/null && $(APT_GET) install tshark >/dev/null || echo "tshark unavailable: its wire test will be skipped"; \
	  else echo "tshark not found: its wire test will be skipped (apt-get install tshark)"; fi; }
	@command -v nft >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing nftables (loss on the LAN tests' links: this kernel has no netem)"; \
	    $(APT_GET) update >/dev/null && $(APT_GET) install nftables >/dev/null || echo "nftables unavailable: the LAN loss drill will be skipped"; \
	  else echo "nft not found: the LAN loss drill will be skipped (apt-get install nftables)"; fi; }
	@command -v ethtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing ethtool (the LAN tests' forwarder needs checksums computed in software)"; \
	    $(APT_GET) update >/dev/null && $(APT_GET) install ethtool >/dev/null || echo "ethtool unavailable: the LAN slow-links drill will be skipped"; \
	  else echo "ethtool not found: the LAN slow-links drill will be skipped (apt-get install ethtool)"; fi; }
	@command -v tmux >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing tmux (the tests read tape watch's live view in a real terminal)"; \
	    $(APT_GET) update >/dev/null && $(APT_GET) install tmux >/dev/null || echo "tmux unavailable: its test will be skipped"; \
	  else echo "tmux not found: the live view's test will be skipped (apt-get install tmux)"; fi; }
	@command -v perf >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing perf (tape bench batch-cost counts a batch's system calls, hashes and allocations with it)"; \
	    $(APT_GET) update >/dev/null && $(APT_GET) install linux-perf >/dev/null || echo "perf unavailable: its bench's test will be skipped"; \
	  else echo "perf not found: tape bench batch-cost's test will be skipped (apt-get install linux-perf)"; fi; }
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing prometheus (the tests check the alert rules with promtool and scrape a cluster)"; \
	    $(APT_GET) update >/dev/null && $(APT_GET) install --no-install-recommends prometheus >/dev/null || echo "prometheus unavailable: its tests will be skipped"; \
	  else echo "promtool not found: the Prometheus tests will be skipped (apt-get install prometheus)"; fi; }

demo: $(STAMP) sysdeps
	$(VENV)/bin/tape up --rate 10000 --duration 10 --drop 0.02 --out runs/demo

test: $(STAMP) sysdeps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q --durations=25
	$(MAKE) --no-print-directory test-pure-fast
	$(MAKE) --no-print-directory test-sanitize

# The inner loop: unit, property and fuzz tests and 200 simulator seeds; no process, no JVM
# (a test of this tier that starts a process fails: tests/conftest.py). Needs no system packages.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	TAPE_TEST_TIER=fast $(VENV)/bin/pytest -q -m "not process and not spark and not slow" --durations=10

# The pure-Python leg: every C extension hidden (TAPE_PURE=1, protocol/extensions.py), so that
# each part runs its Python twin. test-pure is the whole suite; make test runs its fast tier.
test-pure: $(STAMP) sysdeps
	TAPE_PURE=1 $(VENV)/bin/pytest -q --durations=25

test-pure-fast: $(STAMP)
	@echo "the fast tier again with every C extension hidden (TAPE_PURE=1)"
	TAPE_PURE=1 TAPE_TEST_TIER=fast $(VENV)/bin/pytest -q -m "not process and not spark and not slow" --durations=10

# The C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer (tests/build_sanitized.py,
# into build/sanitize) and the tests that drive them, C against Python and fuzzed, with the sanitizers'
# runtime preloaded: any report stops the run (-s: a report is written to the terminal, not captured).
SANITIZE  := build/sanitize
C_TESTS   := test_speedups test_audit_compiled test_audit test_mmsg test_snapshot test_clientmac test_streamauth \
             test_linkauth test_messages test_moldudp64 test_journal test_emitter test_fuzz test_fuzz_decoders
test-sanitize: $(STAMP)
	$(PY) tests/build_sanitized.py $(SANITIZE)
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  PYTHONPATH=$(SANITIZE) TAPE_SANITIZED=$(SANITIZE) TAPE_TEST_TIER=fast \
	  $(PY) -m pytest -q -s -p no:cacheprovider -m "not process and not spark and not slow" \
	  $(addprefix tests/,$(addsuffix .py,$(C_TESTS)))

# make test RUNS times in a row while two busy loops take both cores (each loop
# bounded by timeout, killed at the end): the suite must not depend on an idle machine.
RUNS ?= 10
test-loaded: $(STAMP) sysdeps
	@for i in $$(seq $(RUNS)); do \
	  timeout 1800 sh -c 'while :; do :; done' & b1=$$!; timeout 1800 sh -c 'while :; do :; done' & b2=$$!; \
	  echo "loaded run $$i of $(RUNS)"; $(MAKE) --no-print-directory test; rc=$$?; kill $$b1 $$b2 2>/dev/null; \
	  [ $$rc -eq 0 ] || { echo "loaded run $$i failed"; exit 1; }; \
	done; echo "$(RUNS) loaded runs passed"

# A long run in bounded memory (not in CI): every process's resident memory sampled every 10 s
# into runs/soak/report.json and plotted to runs/soak/memory.png (ops/verification/memory_watch.py).
# Books close SOAK_BOOK_TTL s after they open, so the replicas' memory levels off from then on. The
# journals take 396 bytes a trade (four voters): 66 GiB for these defaults; tape up refuses a run
# its disk or memory cannot hold, before it starts.
SOAK_RATE     ?= 100000
SOAK_S        ?= 1800
SOAK_BOOK_TTL ?= 300
soak: $(STAMP) sysdeps
	$(VENV)/bin/tape up --rate $(SOAK_RATE) --duration $(SOAK_S) --book-ttl $(SOAK_BOOK_TTL) --out runs/soak

bench: $(STAMP)
	$(VENV)/bin/tape bench protocol

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
