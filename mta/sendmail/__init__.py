"""Local submission: the ``sendmail`` and ``mailq`` commands, and the drop directory they share with the relay."""
