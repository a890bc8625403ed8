#include "textflag.h"

// func copyNT(dst, src unsafe.Pointer, n uintptr)
// The non-temporal-store baseline: the same SSE2 loop as goext/transfer's
// copyNT (kept separate so the baseline does not change when kvbm's copy
// does). n is a multiple of 128; dst is 16-byte aligned.
TEXT ·copyNT(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SHRQ $7, CX
	JZ   done

loop:
	MOVOU  0(SI), X0
	MOVOU  16(SI), X1
	MOVOU  32(SI), X2
	MOVOU  48(SI), X3
	MOVOU  64(SI), X4
	MOVOU  80(SI), X5
	MOVOU  96(SI), X6
	MOVOU  112(SI), X7
	MOVNTO X0, 0(DI)
	MOVNTO X1, 16(DI)
	MOVNTO X2, 32(DI)
	MOVNTO X3, 48(DI)
	MOVNTO X4, 64(DI)
	MOVNTO X5, 80(DI)
	MOVNTO X6, 96(DI)
	MOVNTO X7, 112(DI)
	ADDQ   $128, SI
	ADDQ   $128, DI
	DECQ   CX
	JNZ    loop

done:
	SFENCE
	RET
