"""The DiLoCo audit service (`/shoal/audit/1.0.0`): work logs, reveals, referees, bans."""
