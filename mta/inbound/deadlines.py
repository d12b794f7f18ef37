"""When an SMTP client must have done its part: deadlines per command, per DATA phase, per session.

Theory of operation
-------------------
A time limit that restarts on every read is no limit: a client that sends one
byte every few seconds holds its session forever. So the server keeps one
*deadline*, an absolute time, and moves it only when the client has earned it:

- **Command.** When the server starts waiting for a command line (the
  greeting's, or the one after the previous command was complete), the
  deadline is ``now + command_timeout``. Reads of parts of the line do not
  move it. This is Postfix's ``smtpd_timeout`` with
  ``smtpd_per_request_deadline = yes``. Replies are sent under the same
  deadline: a client that does not read them cannot hold the session either.
- **DATA.** At the ``354`` the deadline is ``now + data_timeout``. Every byte
  that arrives buys ``1 / min_data_rate`` seconds more, but the deadline is
  never more than ``data_timeout`` ahead of now, so a client must keep up an
  average rate of ``min_data_rate`` and can never stall longer than
  ``data_timeout`` (Postfix's ``smtpd_min_data_rate``, which works the same
  way). Bytes beyond ``max_message_size`` buy nothing, so a whole DATA phase
  ends at the latest ``data_timeout + max_message_size / min_data_rate`` after
  it began, however the client paces it.
- **Session.** No new command is waited for after ``session_time_limit``
  (checked between commands, so a command or DATA phase under way finishes
  under its own deadline).

Only the client's time counts: while the relay itself waits (the spool's
commit before the ``250``, back-pressure from the disk), the deadline is moved
on by as long as the wait took (``pause``), as Postfix counts only the time
spent in reads and writes.

No I/O here; the server reads ``deadline`` into its cancel scope. Times are
whatever clock the caller uses (``trio.current_time()``).
"""

from __future__ import annotations

import math

import attrs

from mta.config import ServerConfig


@attrs.define
class SessionDeadlines:
    command_timeout: float
    data_timeout: float
    min_data_rate: float
    data_credit_bytes: int  # bytes of one DATA phase that earn time (max_message_size)
    session_end: float
    deadline: float = math.inf
    in_data: bool = False
    _credited: int = 0

    @classmethod
    def for_session(cls, config: ServerConfig, now: float) -> SessionDeadlines:
        return cls(config.command_timeout, config.data_timeout, float(config.min_data_rate),
                   config.max_message_size, now + config.session_time_limit)

    def command(self, now: float) -> None:
        """The server starts waiting for a new command line."""
        self.in_data = False
        self.deadline = now + self.command_timeout

    def data_start(self, now: float) -> None:
        """The DATA command was accepted: the content phase begins."""
        self.in_data = True
        self._credited = 0
        self.deadline = now + self.data_timeout

    def data_end(self) -> None:
        """The content phase is over (end of data, refused, or aborted); a command comes next."""
        self.in_data = False

    def received(self, now: float, nbytes: int) -> None:
        """``nbytes`` arrived at ``now``; inside DATA they buy time, elsewhere nothing."""
        if not self.in_data:
            return
        earning = max(0, min(nbytes, self.data_credit_bytes - self._credited))
        self._credited += earning
        self.deadline = min(self.deadline + earning / self.min_data_rate, now + self.data_timeout)

    def pause(self, seconds: float) -> None:
        """The relay itself kept the client waiting this long: that time is not the client's."""
        self.deadline += seconds

    def session_over(self, now: float) -> bool:
        return now >= self.session_end
