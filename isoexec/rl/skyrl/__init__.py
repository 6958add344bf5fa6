"""SkyRL integration (:mod:`~isoexec.rl.skyrl.driver` and its pieces). Importing this package imports
nothing from ``skyrl``; :mod:`~isoexec.rl.skyrl.compat` must run before the first ``skyrl`` import."""
