"""What every entry point sets up first: the checked settings (`settings`, over `choices`),
the command line (`cli`), the one user error (`errors`), the devices (`platform`), the
processes (`distributed`), and measured figures written as data (`results`)."""
