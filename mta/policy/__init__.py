"""Postfix's policy delegation protocol: the codec (``codec``), the client (``client``) and the checks (``gate``)."""
