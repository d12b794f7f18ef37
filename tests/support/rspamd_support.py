"""rspamd for tests: a normal worker (HTTP ``/checkv2``) and a proxy worker in milter mode, on 127.0.0.1.

The config is Debian's rule set (``$CONFDIR``) with our own top file in the
test's tmp dir: the two workers on free ports, no controller, no Bayes (it
needs Redis), DNS pointed at a closed local port (no outside network), the
test patterns on (GTUBE gets ``reject``), greylisting off (it needs Redis
too), and the milter_headers module adding ``X-Spamd-Result`` and
``X-Rspamd-Server`` to local mail as well, so a clean message shows that
rspamd saw it. Two symbols of our own trigger rspamd's other actions
whatever the scores of Debian's rules: a multimap rule on the test header
``X-Test-Action: rewrite`` or ``add``, which force_actions turns into
"rewrite subject" (``[rspamd says] SUBJECT``) or "add header". Its first start compiles the regexps (about 15 s on the
shared build machine): one instance per test module.
"""

from __future__ import annotations

import getpass
from pathlib import Path

import attrs
from daemon_support import Daemon, free_port

GTUBE = "XJS*C4JDBQADN1.NSBN3*2IDNEN*GTUBE-STANDARD-ANTI-UBE-TEST-EMAIL*C.34X"

_TOP = """\
.include "$CONFDIR/common.conf"
options {{
    pidfile = "{dir}/rspamd.pid";
    .include "$CONFDIR/options.inc"
    enable_test_patterns = true;
    dns {{ nameserver = ["127.0.0.1:9"]; timeout = 0.2s; retransmits = 1; }}
}}
logging {{ type = "file"; filename = "{dir}/rspamd.log"; level = "warning"; }}
worker "normal" {{
    bind_socket = "127.0.0.1:{http}";
    .include "$CONFDIR/worker-normal.inc"
    count = 1;
}}
worker "rspamd_proxy" {{
    bind_socket = "127.0.0.1:{milter}";
    milter = yes;
    timeout = 120s;
    upstream "local" {{ default = yes; self_scan = yes; }}
    count = 1;
    spam_header = "X-Spam";
    reject_message = "Spam message rejected";
}}
lua = "$RULESDIR/rspamd.lua"
.include "$CONFDIR/metrics.conf"
.include "$CONFDIR/actions.conf"
.include "$CONFDIR/groups.conf"
.include "$CONFDIR/composites.conf"
.include "$CONFDIR/modules.conf"
.include "$CONFDIR/settings.conf"
modules {{
  path = "${{PLUGINSDIR}}";
  fallback_path = "${{SHAREDIR}}/lua";
}}
"""
_LOCAL = {
    "milter_headers.conf": 'use = ["x-spamd-result", "x-rspamd-server"];\nskip_local = false;\n'
                           "skip_authenticated = false;\n",
    "actions.conf": "greylist = null;\nrewrite_subject = 12;\nadd_header = 6;\nreject = 15;\n",
    "multimap.conf": 'TEST_ACTION_REWRITE { type = "header"; header = "X-Test-Action"; map = "{dir}/rewrite.map"; '
                     'score = 0.0; }\n'
                     'TEST_ACTION_ADD { type = "header"; header = "X-Test-Action"; map = "{dir}/add.map"; '
                     'score = 0.0; }\n',
    "force_actions.conf": 'rules {\n'
                          '  TEST_FORCE_REWRITE { action = "rewrite subject"; expression = "TEST_ACTION_REWRITE"; '
                          'subject = "[rspamd says] %s"; }\n'
                          '  TEST_FORCE_ADD { action = "add header"; expression = "TEST_ACTION_ADD"; }\n'
                          '}\n',
}
_MAPS = {"rewrite.map": "rewrite\n", "add.map": "add\n"}


@attrs.define
class Rspamd:
    http_port: int
    milter_port: int
    daemon: Daemon

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def start_rspamd(where: Path) -> Rspamd:
    http, milter = free_port(), free_port()
    local = where / "local" / "local.d"
    local.mkdir(parents=True)
    for name, text in _LOCAL.items():
        (local / name).write_text(text.replace("{dir}", str(where)))
    for name, text in _MAPS.items():
        (where / name).write_text(text)
    conf = where / "rspamd.conf"
    conf.write_text(_TOP.format(dir=where, http=http, milter=milter))
    user = getpass.getuser()
    argv = ["rspamd", "-f", "-u", user, "-c", str(conf), *(["-i"] if user == "root" else []),
            "--var", f"LOCAL_CONFDIR={where / 'local'}", "--var", f"DBDIR={where}", "--var", f"RUNDIR={where}",
            "--var", f"LOGDIR={where}"]
    daemon = Daemon(argv, where / "rspamd.out").start([http, milter], timeout=120)
    return Rspamd(http, milter, daemon)
