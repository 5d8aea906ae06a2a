package main

import "github.com/spf13/cobra"

// addDemoFlags lets optional demo parts add their flags.
var demoFlagHooks []func(cmd *cobra.Command)

func addDemoFlags(cmd *cobra.Command) {
	for _, h := range demoFlagHooks {
		h(cmd)
	}
}
